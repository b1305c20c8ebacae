"""Tunnel-era faults as pymobiledevice3 sees them: the tunnel dropping mid-run (the phone stays attached, the
app keeps running, a new tunnel works), a CDTunnel handshake that is never answered, and transient launch
errors reported as NSError of `com.apple.dt.deviceprocesscontrolservice`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pymobiledevice3 import usbmux
from pymobiledevice3.dtx import DTXNsError
from pymobiledevice3.exceptions import PyMobileDevice3Exception
from pymobiledevice3.remote.remote_service_discovery import RemoteServiceDiscoveryService
from pymobiledevice3.remote.userspace_tunnel import UserspaceRsdTunnel
from pymobiledevice3.services.dvt.instruments.dvt_provider import DvtProvider
from pymobiledevice3.services.dvt.instruments.process_control import ProcessControl
from pymobiledevice3.services.installation_proxy import InstallationProxyService

from kvrig.virtual.device import VirtualDevice
from kvrig.virtual.faults import FaultPlan
from tests.virtual.conftest import BUNDLE_ID, TESTAPP_ARGS, Emulator, through_tunnel

IDLE_APP = [*TESTAPP_ARGS, "--max-tokens", "256"]  # grows to 256 tokens, then stays alive


@pytest.fixture(scope="module")
def phone(emulator: Emulator, ipa: Path) -> VirtualDevice:
    device = emulator.host.add_device(emulator.root / "iphone186", ios="18.6")

    async def install(rsd: RemoteServiceDiscoveryService) -> None:
        await InstallationProxyService(rsd).install_from_local(ipa)

    through_tunnel(device, install)
    return device


@pytest.fixture()
def clean(phone: VirtualDevice, emulator: Emulator):  # type: ignore[no-untyped-def]
    yield phone
    phone.faults = FaultPlan()
    emulator.host.run(phone.apps.kill_bundle(BUNDLE_ID))


def test_tunnel_drop_mid_run(clean: VirtualDevice) -> None:
    phone = clean

    async def main() -> tuple[int, BaseException | None]:
        tunnel = UserspaceRsdTunnel(serial=phone.identity.udid, remotepairing_fallback=False)
        async with tunnel as rsd, DvtProvider(rsd) as dvt, ProcessControl(dvt) as control:
            pid = await control.launch(BUNDLE_ID, arguments=IDLE_APP)
            phone.faults = FaultPlan(tunnel_drop_after_bytes=1)  # the next packet breaks the tunnel
            try:
                await asyncio.wait_for(control.process_identifier_for_bundle_identifier(BUNDLE_ID), 30)
            except Exception as exc:  # whatever the dead tunnel surfaces as
                return pid, exc
            return pid, None

    pid, error = asyncio.run(asyncio.wait_for(main(), 90))
    assert error is not None and not isinstance(error, asyncio.TimeoutError)
    assert phone.apps.pid_for_bundle(BUNDLE_ID) == pid  # the app outlives the tunnel
    assert phone.identity.udid in {d.serial for d in asyncio.run(usbmux.list_devices())}
    with pytest.raises((PyMobileDevice3Exception, ConnectionError)):  # while the fault is set, new tunnels drop too
        through_tunnel(phone, lambda rsd: rsd.get_value(key="ProductVersion"))
    phone.faults = FaultPlan()

    async def again(rsd: RemoteServiceDiscoveryService) -> int:
        async with DvtProvider(rsd) as dvt, ProcessControl(dvt) as control:
            return await control.process_identifier_for_bundle_identifier(BUNDLE_ID)

    assert through_tunnel(phone, again) == pid  # a new tunnel finds the same app


def test_handshake_timeout(clean: VirtualDevice) -> None:
    phone = clean
    phone.faults = FaultPlan(handshake_timeout=True)

    async def main() -> None:
        async with UserspaceRsdTunnel(serial=phone.identity.udid, remotepairing_fallback=False):
            pass

    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(main(), 3))
    phone.faults = FaultPlan()
    assert through_tunnel(phone, lambda rsd: asyncio.sleep(0, rsd.product_version)) == "18.6"


def test_transient_launch_errors_then_success(clean: VirtualDevice) -> None:
    phone = clean
    phone.faults = FaultPlan(launch_errors=2)

    async def body(rsd: RemoteServiceDiscoveryService) -> tuple[list[tuple[str, int]], int]:
        errors = []
        async with DvtProvider(rsd) as dvt, ProcessControl(dvt) as control:
            for _ in range(3):
                try:
                    return errors, await control.launch(BUNDLE_ID, arguments=IDLE_APP)
                except DTXNsError as exc:
                    errors.append((exc.error.domain, exc.error.code))
        return errors, 0

    errors, pid = through_tunnel(phone, body)
    assert errors == [("com.apple.dt.deviceprocesscontrolservice", 1)] * 2
    assert pid > 0 and phone.apps.pid_for_bundle(BUNDLE_ID) == pid
