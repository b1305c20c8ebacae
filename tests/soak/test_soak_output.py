"""`kvrig soak -o OUT` is checked before the phone is reached: a folder holding a soak's results is never
overwritten (exit 53), and one that cannot be made is exit 38 naming it (it was a traceback after connecting)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _soak(tmp_path: Path, out: Path) -> subprocess.CompletedProcess[str]:
    # No usbmuxd at this address: a soak that went on to the phone would end there instead (exit 11).
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=str(tmp_path / "no-usbmuxd.sock"))
    return subprocess.run(
        [sys.executable, "-m", "kvrig", "soak", "--app-id", "com.example.app", "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize("earlier", ["results.json", "soakplan.json"])
def test_a_folder_holding_a_soak_is_never_overwritten(tmp_path: Path, earlier: str) -> None:
    out = tmp_path / "soak"
    out.mkdir()
    (out / earlier).write_text("the first run's")
    done = _soak(tmp_path, out)
    assert done.returncode == 53, done.stderr
    assert str(out) in done.stderr and "Traceback" not in done.stderr
    assert [p.name for p in out.iterdir()] == [earlier] and (out / earlier).read_text() == "the first run's"


def test_a_folder_that_cannot_be_made_is_refused_before_the_phone(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    done = _soak(tmp_path, tmp_path / "a-file" / "soak")
    assert done.returncode == 38, done.stderr
    assert "a-file" in done.stderr and "cannot create the output folder" in done.stderr
