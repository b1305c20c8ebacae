"""Fixtures: one emulator (usbmuxd socket + a virtual iOS 16.7 iPhone and an iOS 17.4 one) per test module,
driven with the real pymobiledevice3 library and command line through USBMUXD_SOCKET_ADDRESS."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pymobiledevice3.lockdown import create_using_usbmux
from pymobiledevice3.remote.remote_service_discovery import RemoteServiceDiscoveryService
from pymobiledevice3.remote.userspace_tunnel import UserspaceRsdTunnel
from pymobiledevice3.services.installation_proxy import InstallationProxyService

from examples.make_test_ipa import make_ipa  # the script users run: tests install the same placeholder app
from kvrig.virtual.device import VirtualDevice
from kvrig.virtual.host import EmulatorHost

BUNDLE_ID = "dev.kvrig.soak"
LIMIT_BYTES = 160 * 1024 * 1024
# Small dims so the test app reaches the limit in a few 256-token steps: 8 MiB of fp16 K+V per step.
TESTAPP_ARGS = ["--layers", "8", "--kv-heads", "8", "--head-dim", "128", "--weights-mb", "8"]


class Emulator:
    def __init__(self, host: EmulatorHost, root: Path) -> None:
        self.host = host
        self.root = root
        self.address = host.address
        self.device = host.add_device(root / "iphone", limit_bytes=LIMIT_BYTES)
        self.ios17 = host.add_device(root / "iphone17", ios="17.4")

    @property
    def udid(self) -> str:
        return self.device.identity.udid


@contextmanager
def emulator_host(root: Path, name: str) -> Iterator[EmulatorHost]:
    """An emulator on its own usbmuxd socket, which USBMUXD_SOCKET_ADDRESS names while it runs (pymobiledevice3,
    libimobiledevice and child processes read it); the variable is restored after."""
    # Unix socket paths are limited to ~100 bytes; pytest's temp paths can be longer.
    address = f"/tmp/kvrig-{name}-{os.getpid()}-{root.name}.sock"
    with pytest.MonkeyPatch.context() as env, EmulatorHost(address) as host:
        env.setenv("USBMUXD_SOCKET_ADDRESS", address)
        yield host


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    root = tmp_path_factory.mktemp("virtual")
    with emulator_host(root, "test") as host:
        yield Emulator(host, root)


@pytest.fixture(scope="module")
def ipa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ipa(tmp_path_factory.mktemp("ipa") / "KVSoak.ipa")


def through_tunnel(device: VirtualDevice, body: Callable[[RemoteServiceDiscoveryService], Awaitable[Any]]) -> Any:
    """Runs `body` with an RSD reached through pymobiledevice3's no-root userspace tunnel (never Wi-Fi)."""

    async def main() -> Any:
        async with UserspaceRsdTunnel(serial=device.identity.udid, remotepairing_fallback=False) as rsd:
            return await body(rsd)

    return asyncio.run(asyncio.wait_for(main(), 120))


def install(udid: str, ipa: Path) -> None:
    """Installs `ipa` on the phone through pymobiledevice3's installation_proxy over lockdown."""

    async def main() -> None:
        lockdown = await create_using_usbmux(serial=udid)
        try:
            await InstallationProxyService(lockdown).install_from_local(ipa)
        finally:
            await lockdown.close()

    asyncio.run(main())


def lockdown_values(udid: str) -> dict:
    """Every value lockdownd answers to pymobiledevice3 over usbmuxd."""

    async def main() -> dict:
        lockdown = await create_using_usbmux(serial=udid)
        try:
            return lockdown.all_values
        finally:
            await lockdown.close()

    return asyncio.run(main())
