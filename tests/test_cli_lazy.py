"""Usage errors, and what `kvrig export`, device commands and `plan --backend coreml` must not import (coremltools);
`kvrig --help` itself: tests/test_api.py."""

import subprocess
import sys


def test_unknown_command_is_usage_error():
    proc = subprocess.run([sys.executable, "-m", "kvrig", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "no-such-command" in proc.stderr


CORE_ML_LIGHT = """
import sys
from kvrig.cli import main
for args in (["export", "--help"], ["export", "coreml", "--help"], ["devices", "--help"], ["deploy", "--help"],
             ["plan", "--device", "iPhone16,1", "--backend", "coreml", "--json"]):
    try:
        main(args)
    except SystemExit:
        pass
print('COREML=' + ','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'coremltools')))
"""


def test_export_help_device_commands_and_coreml_plan_do_not_import_coremltools():
    # `plan --backend coreml` counts bytes from the config alone; only the export itself needs coremltools.
    out = subprocess.run([sys.executable, "-c", CORE_ML_LIGHT], capture_output=True, text=True, check=True).stdout
    assert "Core ML program" in out or '"backend": "coreml"' in out
    assert out.rstrip().endswith("COREML=")


def test_every_command_has_one_summary():
    """Help lists each command's click `short_help`, the one place its summary lives."""
    import click

    from kvrig.cli import COMMANDS, cli

    ctx = click.Context(cli)
    for name in COMMANDS:
        cmd = cli.get_command(ctx, name)
        assert cmd is not None and cmd.short_help, name


def test_bench_startup_times_both_commands_side_by_side() -> None:
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "bench", "startup", "--runs", "1", "--json"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    commands = out["commands"]
    assert set(commands) == {"python", "kvrig --help", "pymobiledevice3 --help"}
    assert all(len(c["runs_s"]) == 1 and c["median_s"] > 0 for c in commands.values())
    kvrig, peer = commands["kvrig --help"]["median_s"], commands["pymobiledevice3 --help"]["median_s"]
    assert out["ratio_kvrig_to_pymobiledevice3"] == kvrig / peer
