"""libimobiledevice's tools from Debian (a second, independent client, in C) against the virtual iPhone, on
iOS 16.7, 18.6 and 27.2, through `USBMUXD_SOCKET_ADDRESS=UNIX:/path`: ideviceinfo, idevicedate,
idevicediagnostics, ideviceinstaller, idevicecrashreport and idevicesyslog. `make setup` installs them."""

from __future__ import annotations

import asyncio
import os
import plistlib
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from pymobiledevice3.lockdown import create_using_usbmux
from pymobiledevice3.services.diagnostics import DiagnosticsService
from pymobiledevice3.services.installation_proxy import InstallationProxyService

from kvrig.virtual.device import VirtualDevice
from tests.virtual.conftest import BUNDLE_ID, Emulator, lockdown_values

TOOLS = ("ideviceinfo", "idevicedate", "idevicediagnostics", "ideviceinstaller", "idevicecrashreport", "idevicesyslog")


@pytest.fixture(scope="module", params=["16.7", "18.6", "27.2"])
def phone(request: pytest.FixtureRequest, emulator: Emulator) -> VirtualDevice:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing and not sys.platform.startswith("linux"):  # make setup installs them on Debian only
        pytest.skip(f"libimobiledevice tools missing: {missing} (brew install libimobiledevice ideviceinstaller)")
    assert not missing, f"libimobiledevice tools missing: {missing} (make setup installs them)"
    if request.param == "16.7":
        return emulator.device
    return emulator.host.add_device(emulator.root / f"iphone{request.param}", ios=request.param)


def tool(emulator: Emulator, phone: VirtualDevice, *args: str, timeout: float = 60) -> str:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=f"UNIX:{emulator.address}")
    result = subprocess.run(
        [args[0], "-u", phone.identity.udid, *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert result.returncode == 0, f"{args}: {result.stdout}{result.stderr}"
    return result.stdout


def test_idevice_id_lists_the_phone(emulator: Emulator, phone: VirtualDevice) -> None:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=f"UNIX:{emulator.address}")
    listed = subprocess.run(["idevice_id", "-l"], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert listed.returncode == 0, listed.stderr
    assert phone.identity.udid in listed.stdout.split()


def test_ideviceinfo_agrees_with_pymobiledevice3(emulator: Emulator, phone: VirtualDevice) -> None:
    info = dict(line.split(": ", 1) for line in tool(emulator, phone, "ideviceinfo").splitlines() if ": " in line)
    values = lockdown_values(phone.identity.udid)
    for key in ("UniqueDeviceID", "ProductType", "ProductVersion", "BuildVersion", "SerialNumber"):
        assert info[key] == str(values[key])
    battery = tool(emulator, phone, "ideviceinfo", "-q", "com.apple.mobile.battery", "-k", "BatteryCurrentCapacity")
    assert 0 < int(battery) <= 100


def test_idevicedate_reads_the_phone_clock(emulator: Emulator, phone: VirtualDevice) -> None:
    shown = tool(emulator, phone, "idevicedate").strip()
    stamp = datetime.strptime(shown, "%a %b %d %H:%M:%S %Z %Y").timestamp()
    assert abs(stamp - time.time()) < 120


def test_idevicediagnostics_battery_entry(emulator: Emulator, phone: VirtualDevice) -> None:
    shown = plistlib.loads(tool(emulator, phone, "idevicediagnostics", "ioregentry", "AppleSmartBattery").encode())
    entry = shown["IORegistry"]

    async def main() -> dict:
        lockdown = await create_using_usbmux(serial=phone.identity.udid)
        try:
            async with DiagnosticsService(lockdown) as diagnostics:
                return await diagnostics.ioregistry(name="AppleSmartBattery")
        finally:
            await lockdown.close()

    other = asyncio.run(main())
    assert entry["CurrentCapacity"] == other["CurrentCapacity"]
    assert abs(entry["Temperature"] - other["Temperature"]) < 50
    gauge = plistlib.loads(tool(emulator, phone, "idevicediagnostics", "diagnostics", "GasGauge").encode())
    assert gauge["GasGauge"]["DesignCapacity"] == entry["DesignCapacity"]


def test_ideviceinstaller_installs_lists_and_removes(emulator: Emulator, phone: VirtualDevice, ipa: Path) -> None:
    tool(emulator, phone, "ideviceinstaller", "-i", str(ipa))
    assert BUNDLE_ID in tool(emulator, phone, "ideviceinstaller", "-l")

    async def lookup() -> dict:
        lockdown = await create_using_usbmux(serial=phone.identity.udid)
        try:
            return await InstallationProxyService(lockdown).get_apps(bundle_identifiers=[BUNDLE_ID])
        finally:
            await lockdown.close()

    assert BUNDLE_ID in asyncio.run(lookup())
    tool(emulator, phone, "ideviceinstaller", "-U", BUNDLE_ID)
    assert BUNDLE_ID not in tool(emulator, phone, "ideviceinstaller", "-l")
    assert BUNDLE_ID not in asyncio.run(lookup())


def test_idevicecrashreport_moves_and_copies(emulator: Emulator, phone: VirtualDevice, tmp_path: Path) -> None:
    name = f"JetsamEvent-2026-03-04-050607-{phone.ios_major}.ips"
    body = '{"bug_type":"298"}\n{"memoryStatus":{}}\n'
    (phone.state.crash_pending / name).write_text(body)
    tool(emulator, phone, "idevicecrashreport", "-k", str(tmp_path))
    assert (tmp_path / name).read_text() == body
    assert (phone.state.crash / name).exists() and not (phone.state.crash_pending / name).exists()


def test_idevicesyslog_streams(emulator: Emulator, phone: VirtualDevice) -> None:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=f"UNIX:{emulator.address}")
    proc = subprocess.Popen(
        ["idevicesyslog", "-u", phone.identity.udid],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    timer = threading.Timer(60, proc.kill)
    timer.start()
    seen = ""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen = line
            if "SpringBoard[34]" in line:
                break
    finally:
        timer.cancel()
        proc.terminate()
        proc.communicate(timeout=10)
    assert "SpringBoard[34]" in seen
