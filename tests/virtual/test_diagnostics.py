"""What a phone answers that kvrig reads for telemetry and other clients rely on: the date keys of lockdownd
(checked against the host clock), and the diagnostics relay's battery (IORegistry `AppleSmartBattery`, also
found as `IOPMPowerSource`) whose temperature rises while an app computes and stays put while the phone idles."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from pymobiledevice3.lockdown import create_using_usbmux
from pymobiledevice3.services.diagnostics import DiagnosticsService

from kvrig.virtual.footprint import cpu_seconds
from tests.virtual.conftest import BUNDLE_ID, Emulator, install


async def _battery(udid: str) -> tuple[dict, dict, dict]:
    lockdown = await create_using_usbmux(serial=udid)
    try:
        async with DiagnosticsService(lockdown) as diagnostics:
            by_name = await diagnostics.ioregistry(name="AppleSmartBattery")
            by_class = await diagnostics.get_battery()
        level = await lockdown.get_value(domain="com.apple.mobile.battery")
        return by_name, by_class, level
    finally:
        await lockdown.close()


def test_date_keys_follow_the_clock(emulator: Emulator) -> None:
    async def main() -> tuple[float, dict]:
        lockdown = await create_using_usbmux(serial=emulator.udid)
        try:
            return await lockdown.get_value(key="TimeIntervalSince1970"), lockdown.all_values
        finally:
            await lockdown.close()

    before = time.time()
    stamp, values = asyncio.run(main())
    assert before - 1 <= stamp <= time.time() + 1
    assert isinstance(values["TimeZone"], str) and isinstance(values["Uses24HourClock"], bool)
    assert values["TimeZoneOffsetFromUTC"] == 0.0


def test_battery_entry(emulator: Emulator) -> None:
    by_name, by_class, level = asyncio.run(_battery(emulator.udid))
    assert by_class["IORegistryEntryName"] == by_name["IORegistryEntryName"] == "AppleSmartBattery"
    assert 2000 < by_name["Temperature"] < 4500  # centi-degrees Celsius
    assert 0 < by_name["CurrentCapacity"] <= 100 and by_name["MaxCapacity"] == 100
    assert by_name["ExternalConnected"] is True  # on a USB cable
    assert level["BatteryCurrentCapacity"] == by_name["CurrentCapacity"]
    assert level["BatteryIsCharging"] == by_name["IsCharging"]


def test_temperature_rises_under_load_and_not_at_idle(emulator: Emulator, ipa: Path) -> None:
    idle_1 = asyncio.run(_battery(emulator.udid))[0]["Temperature"]
    time.sleep(0.5)
    idle_2 = asyncio.run(_battery(emulator.udid))[0]["Temperature"]
    assert idle_2 == pytest.approx(idle_1, abs=5)  # within 0.05 °C: nothing ran

    install(emulator.udid, ipa)
    busy = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--weights-mb", "1"]
    busy += ["--decode-tokens", "400", "--max-tokens", "200000"]
    pid = emulator.host.run(emulator.device.apps.launch(BUNDLE_ID, arguments=busy))
    try:
        deadline = time.monotonic() + 120
        while cpu_seconds(pid) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert cpu_seconds(pid) >= 4, "the app never got 4 s of CPU"
        loaded = asyncio.run(_battery(emulator.udid))[0]
    finally:
        emulator.host.run(emulator.device.apps.kill_bundle(BUNDLE_ID))
    assert loaded["Temperature"] > idle_2 + 20  # warmer by more than 0.2 °C
    assert loaded["InstantAmperage"] < 600  # the load draws against the charger


@pytest.mark.parametrize(
    ("shown", "seconds"),
    [("00:00:01\n", 1.0), ("01:02:03", 3723.0), ("2-00:00:05", 172805.0), ("0:07.25", 7.25), ("12:34.50", 754.5)],
)
def test_ps_time_as_procps_and_macos_print_it(shown: str, seconds: float) -> None:
    """Where there is no /proc (macOS) the virtual phone's CPU time comes from ps: procps prints [DD-]HH:MM:SS,
    macOS M:SS.ss. The virtual battery warms and the JetsamEvent report's cpuTime come from it."""
    from kvrig.virtual.footprint import ps_time_seconds

    assert ps_time_seconds(shown) == seconds
    assert ps_time_seconds("-") == 0.0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="holds ps to Linux's /proc")
def test_ps_agrees_with_proc_about_a_busy_process() -> None:
    """The two ways of reading a process's CPU time against each other (cpu_seconds reads /proc here, ps where
    there is none), on a child that spins for a while."""
    import subprocess
    import sys

    from kvrig.virtual.footprint import ps_time_seconds

    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nend = time.process_time() + 3\nwhile time.process_time() < end: pass\nsys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while cpu_seconds(busy.pid) < 2.5 and time.monotonic() < deadline:
            time.sleep(0.2)
        proc = cpu_seconds(busy.pid)
        shown = subprocess.run(["ps", "-o", "time=", "-p", str(busy.pid)], capture_output=True, text=True).stdout
        assert proc >= 2.5 and abs(ps_time_seconds(shown) - proc) <= 1.0, (shown, proc)  # procps shows whole seconds
    finally:
        busy.kill()
        busy.wait()
