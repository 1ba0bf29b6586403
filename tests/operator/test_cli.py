"""`kubellm operator` and `kubellm render` plug into the CLI without heavy imports."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from kubellm.operator import cli, render


def test_operator_arguments():
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["-n", "llm", "-n", "team-*", "--resync-seconds", "30"])
    assert args.namespace == ["llm", "team-*"]
    assert args.resync_seconds == 30
    assert args.peering is None and args.liveness is None


def test_render_arguments():
    parser = argparse.ArgumentParser()
    render.configure(parser)
    args = parser.parse_args(["-f", "a.yaml", "-f", "b.yaml", "-o", "json"])
    assert args.filename == ["a.yaml", "b.yaml"] and args.output == "json"


def test_cli_modules_import_no_kopf():
    code = (
        "import sys, kubellm.operator.cli, kubellm.operator.render; "
        "print('kopf' in sys.modules, 'yaml' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "False"


def test_endpoint_picker_arguments(capsys):
    from kubellm.operator import builders

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    assert cli.picker_options(parser.parse_args([])) == builders.PickerOptions()
    args = parser.parse_args([
        "--epp-image", "reg/kubellm:2", "--epp-fallback-forwarder", "gw.sys.svc:80",
        "--epp-resources", '{"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}',
    ])  # fmt: skip
    options = cli.picker_options(args)
    assert (options.shared, options.image, options.fallback_forwarder) == (
        None, "reg/kubellm:2", "gw.sys.svc:80",
    )  # fmt: skip
    assert options.resources == {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}
    shared = cli.picker_options(parser.parse_args(["--shared-endpoint-picker", "kubellm-epp"]))
    assert shared.shared == "kubellm-epp"
    for bad in ("[1]", "{", '{"request": {}}'):
        with pytest.raises(SystemExit):
            parser.parse_args(["--epp-resources", bad])
    assert "--epp-resources" in capsys.readouterr().err
