"""`python -m kubellm.engine ...`: the same as `kubellm engine ...`, without the other commands."""

from __future__ import annotations

import argparse
import sys

from kubellm.engine import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubellm engine", description=cli.__doc__.split("\n")[0])
    cli.configure(parser)
    return cli.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
