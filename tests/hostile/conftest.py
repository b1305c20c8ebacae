"""The reliability suite's phones: the device tests' emulator (a 16.7 iPhone 15 Pro at 160 MiB and a 17.4 one on
a private usbmuxd socket) with the test app installed, and the `kvrig` command run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvrig.virtual.faults import FaultPlan
from tests.device.conftest import BUNDLE_ID, Emulator, emulator, installed, ipa, on_device, run

__all__ = ["BUNDLE_ID", "ROOT", "Emulator", "Ran", "emulator", "installed", "ipa", "kvrig", "lying", "on_device", "run"]
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    seconds: float


def kvrig(*args: str, env: dict[str, str] | None = None, timeout: float = 300, **kwargs) -> Ran:  # type: ignore[no-untyped-def]
    """`python -m kvrig ARGS` in a fresh process, timed; the timeout is a safety net, bounds are asserted."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvrig", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
        timeout=timeout,
        **kwargs,
    )
    return Ran(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


@pytest.fixture()
def lying(installed: Emulator) -> Iterator[Emulator]:
    """The phone with the test app, its faults cleared, its app stopped and its crash store emptied after."""
    yield installed
    installed.device.faults = FaultPlan()
    installed.host.run(installed.device.replug())
    installed.host.run(installed.device.apps.kill_all())
    for entry in installed.device.state.crash.iterdir():
        if entry.is_dir():
            entry.rmdir()
        else:
            entry.unlink()
