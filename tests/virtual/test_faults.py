"""Injected faults, seen through pymobiledevice3: unplug mid-transfer, refused service, app crash and hang
at a token count, slow link."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from pycrashreport.crash_report import BugType, get_crash_report_from_buf
from pymobiledevice3 import usbmux
from pymobiledevice3.exceptions import InvalidServiceError, PyMobileDevice3Exception
from pymobiledevice3.lockdown import create_using_usbmux
from pymobiledevice3.services.afc import AfcService

from kvrig.virtual.faults import FaultPlan
from tests.virtual.conftest import BUNDLE_ID, TESTAPP_ARGS, Emulator, install


@pytest.fixture()
def clean_faults(emulator: Emulator):  # type: ignore[no-untyped-def]
    yield emulator
    emulator.device.faults = FaultPlan()
    emulator.host.run(emulator.device.replug())


def test_unplug_after_afc_bytes_drops_the_transfer_and_the_device(clean_faults: Emulator) -> None:
    emulator = clean_faults
    emulator.device.afc_bytes = 0
    emulator.device.faults = FaultPlan(unplug_after_afc_bytes=200_000)

    async def main() -> None:
        lockdown = await create_using_usbmux(serial=emulator.udid)
        try:
            async with AfcService(lockdown) as afc:
                await afc.set_file_contents("/Downloads/big.bin", bytes(1_000_000))
        finally:
            await lockdown.close()

    with pytest.raises((PyMobileDevice3Exception, ConnectionError, OSError)):
        asyncio.run(main())
    serials = {d.serial for d in asyncio.run(usbmux.list_devices())}
    assert emulator.udid not in serials
    assert emulator.ios17.identity.udid in serials  # the other device on the socket is unaffected
    emulator.host.run(emulator.device.replug())
    assert emulator.udid in {d.serial for d in asyncio.run(usbmux.list_devices())}


def test_refused_service(clean_faults: Emulator) -> None:
    clean_faults.device.faults = FaultPlan(refuse_services={"com.apple.afc"})

    async def main() -> None:
        lockdown = await create_using_usbmux(serial=clean_faults.udid)
        try:
            async with AfcService(lockdown) as afc:
                await afc.listdir("/")
        finally:
            await lockdown.close()

    with pytest.raises(InvalidServiceError):
        asyncio.run(main())


def test_crash_at_tokens(clean_faults: Emulator, ipa: Path) -> None:
    emulator = clean_faults
    install(emulator.udid, ipa)
    emulator.device.faults = FaultPlan(crash_at_tokens=512)
    pid = emulator.host.run(emulator.device.apps.launch(BUNDLE_ID, arguments=TESTAPP_ARGS))
    process = emulator.host.run(emulator.device.apps.wait(pid, 60), timeout=70)
    assert process.outcome == "crash"
    assert process.proc.returncode == -11  # SIGSEGV
    assert process.account.last.context_tokens == 512
    (report,) = emulator.device.state.crash.glob("KVSoak-*.ips")
    assert get_crash_report_from_buf(report.read_text()).bug_type == BugType.Crash_309
    report.unlink()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process state from Linux's /proc")
def test_hang_at_tokens_leaves_a_stopped_process(clean_faults: Emulator, ipa: Path) -> None:
    emulator = clean_faults
    install(emulator.udid, ipa)
    emulator.device.faults = FaultPlan(hang_at_tokens=256)
    apps = emulator.device.apps
    pid = emulator.host.run(apps.launch(BUNDLE_ID, arguments=TESTAPP_ARGS))
    deadline = time.monotonic() + 60
    state = ""
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            break
        time.sleep(0.1)
    assert state == "T"  # stopped: alive but making no progress
    assert apps.pid_for_bundle(BUNDLE_ID) == pid
    emulator.host.run(apps.kill_bundle(BUNDLE_ID))
    assert apps.pid_for_bundle(BUNDLE_ID) == 0


def test_slow_link_paces_transfers(clean_faults: Emulator) -> None:
    clean_faults.device.faults = FaultPlan(slow_link_bytes_per_s=100_000)

    async def main() -> float:
        lockdown = await create_using_usbmux(serial=clean_faults.udid)
        try:
            async with AfcService(lockdown) as afc:
                start = time.monotonic()
                await afc.set_file_contents("/Downloads/slow.bin", bytes(100_000))
                return time.monotonic() - start
        finally:
            await lockdown.close()

    # 100 kB at 100 kB/s cannot arrive in less than a second
    assert asyncio.run(main()) >= 1.0


@pytest.mark.parametrize(
    ("fault", "outcome", "returncode", "exception"),
    [
        (FaultPlan(gpu_background_at_tokens=256), "gpu_background", -6, "EXC_CRASH"),  # SIGABRT: MLX's abort
        (FaultPlan(watchdog_at_tokens=256), "watchdog", -9, "EXC_CRASH"),  # SIGKILL by FrontBoard
    ],
)
def test_ends_with_a_crash_report_that_pycrashreport_reads(
    clean_faults: Emulator, ipa: Path, fault: FaultPlan, outcome: str, returncode: int, exception: str
) -> None:
    emulator = clean_faults
    install(emulator.udid, ipa)
    emulator.device.faults = fault
    pid = emulator.host.run(emulator.device.apps.launch(BUNDLE_ID, arguments=TESTAPP_ARGS))
    process = emulator.host.run(emulator.device.apps.wait(pid, 60), timeout=70)
    assert process.outcome == outcome and process.proc.returncode == returncode
    (report,) = emulator.device.state.crash.glob("KVSoak-*.ips")
    parsed = get_crash_report_from_buf(report.read_text())
    assert parsed.bug_type == BugType.Crash_309
    assert parsed.exception_type == exception
    report.unlink()


def test_the_faults_of_each_end_cross_the_control_channel() -> None:
    """`kvrig virtual start` flags and `set_faults` carry them as plist values (no null): set ones only."""
    plan = FaultPlan(jetsam_without_report=True, watchdog_at_tokens=512, vanish_at_tokens=1024)
    data = plan.to_json()
    assert data["jetsam_without_report"] is True and "gpu_background_at_tokens" not in data
    assert FaultPlan.from_json(data) == plan
