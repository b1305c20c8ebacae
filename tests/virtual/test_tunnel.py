"""iOS 17.4+ through the tunnel, driven by pymobiledevice3's own no-root path: `UserspaceRsdTunnel` opens
CoreDeviceProxy over lockdown, runs the CDTunnel handshake and its userspace TCP/IP stack (pmd-pytcp) against
the phone's IPv6/TCP endpoint, then RemoteServiceDiscovery over HTTP/2; the services it lists are used with
their RSD names (remote lockdown, shims with RSD check-in, DTX process control). 17.0 refuses CoreDeviceProxy
as a real 17.0 phone does, and 16.7 keeps serving developer services over lockdown."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from pymobiledevice3.exceptions import (
    ConnectionTerminatedError,
    InvalidServiceError,
    UserspaceTunnelUnavailableError,
)
from pymobiledevice3.lockdown import create_using_usbmux
from pymobiledevice3.remote import remotexpc
from pymobiledevice3.remote.remote_service_discovery import RemoteServiceDiscoveryService
from pymobiledevice3.remote.tunnel_service import CoreDeviceTunnelProxy
from pymobiledevice3.services.afc import AfcService
from pymobiledevice3.services.dvt.instruments.dvt_provider import DvtProvider
from pymobiledevice3.services.dvt.instruments.process_control import ProcessControl
from pymobiledevice3.services.installation_proxy import InstallationProxyService

from kvrig.virtual.device import VirtualDevice
from kvrig.virtual.faults import FaultPlan
from kvrig.virtual.rsd import REATTACH_LOG
from tests.virtual.conftest import BUNDLE_ID, TESTAPP_ARGS, Emulator, lockdown_values, through_tunnel

INSTRUMENTS = "com.apple.instruments.dtservicehub"


@pytest.fixture(scope="module")
def phones(emulator: Emulator) -> dict[str, VirtualDevice]:
    return {
        "17.0": emulator.host.add_device(emulator.root / "iphone170", ios="17.0"),
        "18.6": emulator.host.add_device(emulator.root / "iphone186", ios="18.6", profile="iPhone17,1"),
        "26.1": emulator.host.add_device(emulator.root / "iphone261", ios="26.1"),
        "27.0.1": emulator.host.add_device(emulator.root / "iphone2701", ios="27.0.1", profile="iPhone17,1"),
        "27.2": emulator.host.add_device(emulator.root / "iphone272", ios="27.2"),
    }


def test_rsd_names_the_phone_and_its_services(phones: dict[str, VirtualDevice]) -> None:
    phone = phones["18.6"]

    async def body(rsd: RemoteServiceDiscoveryService) -> tuple[dict, str, bool]:
        return rsd.peer_info or {}, await rsd.get_value(key="ProductVersion"), rsd.is_in_process_tunnel

    peer, remote_version, in_process = through_tunnel(phone, body)

    values = lockdown_values(phone.identity.udid)
    properties = peer["Properties"]
    assert properties["UniqueDeviceID"] == values["UniqueDeviceID"]
    assert properties["ProductType"] == values["ProductType"] == "iPhone17,1"
    assert properties["OSVersion"] == values["ProductVersion"] == remote_version == "18.6"
    assert properties["UniqueChipID"] == values["UniqueChipID"]
    services = peer["Services"]
    assert {"com.apple.mobile.lockdown.remote.trusted", "com.apple.afc.shim.remote", INSTRUMENTS} <= set(services)
    assert len({entry["Port"] for entry in services.values()}) == len(services)
    assert in_process


def test_shim_service_over_the_tunnel(phones: dict[str, VirtualDevice]) -> None:
    async def body(rsd: RemoteServiceDiscoveryService) -> list[str]:
        async with AfcService(rsd) as afc:
            await afc.set_file_contents("/Downloads/through-tunnel.txt", b"x" * 100_000)
            assert await afc.get_file_contents("/Downloads/through-tunnel.txt") == b"x" * 100_000
            return await afc.listdir("/Downloads")

    assert "through-tunnel.txt" in through_tunnel(phones["18.6"], body)
    assert (phones["18.6"].state.media / "Downloads/through-tunnel.txt").stat().st_size == 100_000


def test_process_control_launches_and_kills_through_the_tunnel(phones: dict[str, VirtualDevice], ipa: Path) -> None:
    phone = phones["18.6"]

    async def body(rsd: RemoteServiceDiscoveryService) -> tuple[int, int, int]:
        await InstallationProxyService(rsd).install_from_local(ipa)
        async with DvtProvider(rsd) as dvt, ProcessControl(dvt) as control:
            pid = await control.launch(BUNDLE_ID, arguments=[*TESTAPP_ARGS, "--max-tokens", "256"])
            looked_up = await control.process_identifier_for_bundle_identifier(BUNDLE_ID)
            await control.kill(pid)
            for _ in range(100):
                if not await control.process_identifier_for_bundle_identifier(BUNDLE_ID):
                    break
                await asyncio.sleep(0.1)
            return pid, looked_up, await control.process_identifier_for_bundle_identifier(BUNDLE_ID)

    pid, looked_up, after_kill = through_tunnel(phone, body)
    assert pid > 0 and looked_up == pid
    assert after_kill == 0
    assert phone.apps.finished[pid].outcome == "killed"


def test_pymobiledevice3_cli_goes_through_the_tunnel_by_itself(
    emulator: Emulator, phones: dict[str, VirtualDevice], ipa: Path
) -> None:
    phone = phones["18.6"]
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=emulator.address, PYMOBILEDEVICE3_UDID=phone.identity.udid)
    env.pop("PYMOBILEDEVICE3_DEFAULT_FALLBACK", None)  # the CLI's own default: the no-root userspace tunnel

    def cli(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "pymobiledevice3", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        assert result.returncode == 0, f"{args}: {result.stdout}\n{result.stderr}"
        return result.stdout

    cli("apps", "install", str(ipa))
    launched = cli("developer", "dvt", "launch", f"{BUNDLE_ID} --max-tokens 256 --layers 2")
    pid = int(re.search(r"pid (\d+)", launched).group(1))  # type: ignore[union-attr]
    assert phone.apps.pid_for_bundle(BUNDLE_ID) == pid
    cli("developer", "dvt", "kill", str(pid))
    assert emulator.host.run(phone.apps.wait(pid, 20)).outcome == "killed"
    assert json.loads(cli("amfi", "developer-mode-status")) is True


def test_instruments_only_while_the_image_is_mounted(phones: dict[str, VirtualDevice]) -> None:
    phone = phones["26.1"]
    phone.faults = FaultPlan(image_missing=True)

    async def body(rsd: RemoteServiceDiscoveryService) -> set[str]:
        with pytest.raises(InvalidServiceError):
            async with DvtProvider(rsd):
                pass
        return set((rsd.peer_info or {})["Services"])

    try:
        services = through_tunnel(phone, body)
    finally:
        phone.faults = FaultPlan()
    assert INSTRUMENTS not in services
    assert "com.apple.mobile.mobile_image_mounter.shim.remote" in services


def test_17_0_has_no_core_device_proxy(phones: dict[str, VirtualDevice]) -> None:
    phone = phones["17.0"]

    async def proxy() -> None:
        lockdown = await create_using_usbmux(serial=phone.identity.udid)
        try:
            await CoreDeviceTunnelProxy.create(lockdown)
        finally:
            await lockdown.close()

    with pytest.raises(InvalidServiceError):
        asyncio.run(proxy())
    with pytest.raises(UserspaceTunnelUnavailableError):
        through_tunnel(phone, lambda rsd: asyncio.sleep(0))


def test_16_7_keeps_developer_services_on_lockdown(emulator: Emulator) -> None:
    async def main() -> None:
        lockdown = await create_using_usbmux(serial=emulator.udid)
        try:
            async with DvtProvider(lockdown) as dvt, ProcessControl(dvt) as control:
                assert await control.process_identifier_for_bundle_identifier(BUNDLE_ID) == 0
            with pytest.raises(InvalidServiceError):
                await CoreDeviceTunnelProxy.create(lockdown)
        finally:
            await lockdown.close()

    asyncio.run(main())


# iOS 27 as AppleDB records it (littlebyteorg/appledb, osFiles/iOS/24x - 27.x/24A446.json and 24B5099f.json):
# the 27.0.1 release and the build of the third 27.2 seed. Not read from kvrig's own table.
IOS_27_BUILDS = {"27.0.1": "24A446", "27.2": "24B5099f"}


@pytest.mark.parametrize("version", sorted(IOS_27_BUILDS))
def test_ios_27_names_its_release_over_lockdown_and_rsd(phones: dict[str, VirtualDevice], version: str) -> None:
    phone = phones[version]

    async def body(rsd: RemoteServiceDiscoveryService) -> tuple[dict, str, int]:
        async with DvtProvider(rsd) as dvt, ProcessControl(dvt) as control:
            pid = await control.process_identifier_for_bundle_identifier(BUNDLE_ID)
        return rsd.peer_info or {}, await rsd.get_value(key="BuildVersion"), pid

    peer, remote_build, pid = through_tunnel(phone, body)
    values = lockdown_values(phone.identity.udid)
    assert values["ProductVersion"] == peer["Properties"]["OSVersion"] == version
    assert values["BuildVersion"] == peer["Properties"]["BuildVersion"] == remote_build == IOS_27_BUILDS[version]
    assert INSTRUMENTS in peer["Services"] and pid == 0  # developer services through the tunnel, as on 26


def test_ios_27_2_keeps_its_services_for_the_pinned_client_across_tunnels(phones: dict[str, VirtualDevice]) -> None:
    """The pinned pymobiledevice3 presents one UUID in every RSD handshake, so 27.2's remoted never re-attaches:
    a second tunnel (a soak's reopen after a drop) still reaches process control."""
    phone = phones["27.2"]

    async def body(rsd: RemoteServiceDiscoveryService) -> int:
        async with DvtProvider(rsd) as dvt, ProcessControl(dvt) as control:
            return await control.process_identifier_for_bundle_identifier(BUNDLE_ID)

    assert through_tunnel(phone, body) == 0
    assert through_tunnel(phone, body) == 0
    assert phone.rsd_peer_uuid == remotexpc.default_handshake_uuid() and not phone.rsd_reattached
    assert all(line.message != REATTACH_LOG for line in phone.syslog.history)


@pytest.mark.parametrize(("version", "reattaches"), [("27.2", True), ("26.1", False)])
def test_a_fresh_handshake_uuid_closes_27_2s_services(
    phones: dict[str, VirtualDevice], version: str, reattaches: bool
) -> None:
    """What pymobiledevice3 before 11.16 did (a new UUID in every handshake, doronz88/pymobiledevice3#1966): on
    27.2 the phone re-attaches and every advertised port refuses, the newcomer's too, until a handshake with the
    kept UUID re-discovers them; 26.1 does not care."""
    phone = phones[version]

    async def body(rsd: RemoteServiceDiscoveryService) -> tuple[bool, bool, int]:
        fresh = RemoteServiceDiscoveryService(
            rsd.service.address, open_connection=rsd.open_connection, handshake_uuid=uuid.uuid4()
        )
        refused = False
        try:
            await fresh.connect()  # the handshake, then the remote lockdown service: where #1966 broke
            async with AfcService(fresh) as afc:
                await afc.listdir("/")
        except (ConnectionTerminatedError, OSError):
            refused = True
        finally:
            await fresh.close()
        attempts = 0
        listed = False
        while not listed and attempts < 2:  # the host's own UUID: the first re-attaches, the next re-discovers
            attempts += 1
            again = RemoteServiceDiscoveryService(rsd.service.address, open_connection=rsd.open_connection)
            try:
                await again.connect()
                async with AfcService(again) as afc:
                    listed = "Downloads" in await afc.listdir("/")
            except (ConnectionTerminatedError, OSError):
                pass
            finally:
                await again.close()
        return refused, listed, attempts

    refused, listed_after, attempts = through_tunnel(phone, body)
    assert refused is reattaches
    assert listed_after and not phone.rsd_reattached and attempts == (2 if reattaches else 1)
    assert any(line.message == REATTACH_LOG for line in phone.syslog.history) is reattaches
