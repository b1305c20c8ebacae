"""Two virtual iPhones with small limits on one private usbmuxd socket (an iPhone 15 Pro at 160 MiB and an
iPhone 13 Pro at 128 MiB), the test app installed on both, driven by the real pymobiledevice3 client."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.device.conftest import BUNDLE_ID, make_ipa, on_device, run
from toolchain.device import apps
from toolchain.virtual.device import VirtualDevice
from toolchain.virtual.host import EmulatorHost

__all__ = ["BUNDLE_ID", "MIB", "Phones", "on_device", "phones", "run"]
MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Phones:
    host: EmulatorHost
    address: str
    pro15: VirtualDevice  # iPhone16,1, 160 MiB
    pro13: VirtualDevice  # iPhone14,2, 128 MiB
    ipa: Path

    def telemetry(self, device: VirtualDevice) -> Path:
        return device.state.container(BUNDLE_ID) / "Documents" / "telemetry.jsonl"


@pytest.fixture(scope="module")
def phones(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phones]:
    root = tmp_path_factory.mktemp("lab-phones")
    address = f"/tmp/kvrig-lab-{os.getpid()}.sock"  # unix socket paths are limited to ~100 bytes
    previous = os.environ.get("USBMUXD_SOCKET_ADDRESS")
    os.environ["USBMUXD_SOCKET_ADDRESS"] = address
    ipa = make_ipa(root / "KVSoak.ipa")
    with EmulatorHost(address) as host:
        pro15 = host.add_device(root / "pro15", profile="iPhone16,1", limit_bytes=160 * MIB, baseline_bytes=48 * MIB)
        pro13 = host.add_device(root / "pro13", profile="iPhone14,2", limit_bytes=128 * MIB, baseline_bytes=48 * MIB)
        for device in (pro15, pro13):
            run(on_device(device.identity.udid, lambda d: apps.install(d, ipa)))
        yield Phones(host, address, pro15, pro13, ipa)
    if previous is None:
        os.environ.pop("USBMUXD_SOCKET_ADDRESS", None)
    else:
        os.environ["USBMUXD_SOCKET_ADDRESS"] = previous
