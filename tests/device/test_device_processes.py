"""DTX process control through kvrig.device.processes; iOS 17.4 without a tunnel is refused clearly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvrig.device.processes import Processes, kill_app, pid_for
from kvrig.exceptions import AppError, ServiceRefusedError
from tests.device.conftest import BUNDLE_ID, Emulator, installed, on_device, run

__all__ = ["installed"]


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_launch_pid_kill(installed: Emulator) -> None:
    async def job(device):  # type: ignore[no-untyped-def]
        async with Processes(device) as p:
            pid = await p.launch(BUNDLE_ID, arguments=["--max-tokens", "256", "--step-tokens", "256"])
            looked_up = await p.pid_for(BUNDLE_ID)
            running = dict(installed.device.apps.running())
            await p.kill(pid)
            return pid, looked_up, running

    pid, looked_up, running = run(on_device(installed.udid, job))
    assert pid > 0 and looked_up == pid
    assert running.get(pid) == "KVSoak"  # the emulator runs it under the app's executable name
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    assert run(on_device(installed.udid, lambda d: pid_for(d, BUNDLE_ID))) == 0
    assert run(on_device(installed.udid, lambda d: kill_app(d, BUNDLE_ID))) == 0  # nothing left to kill


def test_launch_unknown_app_is_app_error(installed: Emulator) -> None:
    async def job(device):  # type: ignore[no-untyped-def]
        async with Processes(device) as p:
            await p.launch("com.example.not.installed")

    with pytest.raises(AppError, match="not installed"):
        run(on_device(installed.udid, job))


def test_ios17_without_tunnel_is_refused(emulator: Emulator) -> None:
    with pytest.raises(ServiceRefusedError) as refused:
        run(on_device(emulator.ios17.identity.udid, lambda d: pid_for(d, BUNDLE_ID)))
    assert "iOS 17" in str(refused.value) and "tunnel" in str(refused.value)
    assert refused.value.exit_code == 12
