"""Two virtual iPhones with small limits on one private usbmuxd socket (an iPhone 15 Pro at 160 MiB and an
iPhone 13 Pro at 128 MiB), the test app installed on both, driven by the real pymobiledevice3 client."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvrig.device import apps
from kvrig.virtual.device import VirtualDevice
from kvrig.virtual.host import EmulatorHost
from tests.device.conftest import BUNDLE_ID, make_ipa, on_device, run
from tests.virtual.conftest import emulator_host

__all__ = ["BUNDLE_ID", "FAST", "MIB", "Phones", "on_device", "phones", "run", "short_entry"]
MIB = 1024 * 1024
FAST = {"hang_after_s": 30, "reconnect_s": 1, "report_wait_s": 5, "poll_interval_s": 0.2}
"""Lab timeouts for the virtual phones: a hang or a lost phone shows within seconds."""
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
    ipa = make_ipa(root / "KVSoak.ipa")
    with emulator_host(root, "lab") as host:
        pro15 = host.add_device(root / "pro15", profile="iPhone16,1", limit_bytes=160 * MIB, baseline_bytes=48 * MIB)
        pro13 = host.add_device(root / "pro13", profile="iPhone14,2", limit_bytes=128 * MIB, baseline_bytes=48 * MIB)
        for device in (pro15, pro13):
            run(on_device(device.identity.udid, lambda d: apps.install(d, ipa)))
        yield Phones(host, host.address, pro15, pro13, ipa)


def short_entry(ipa: Path | None = None, **changes: Any) -> dict[str, Any]:
    """The lab entry most lab tests run: the test app in fp16, two 256-token steps to 512 (every phone holds it)."""
    entry: dict[str, Any] = {
        "name": "short",
        "app_id": BUNDLE_ID,
        "schemes": ["fp16"],
        "soak": {"step_tokens": 256, "max_tokens": 512, "decode_tokens": 1},
    }
    if ipa is not None:
        entry["ipa"] = str(ipa)
    return {**entry, **changes}
