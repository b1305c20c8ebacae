"""Running `kvrig` in the test's own process, as tests of a command's output do (kvrig.cli.main: the one error
mapping a user meets)."""

from __future__ import annotations

import pytest

from kvrig.cli import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `kvrig ARGS...`."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
