"""The virtual iPhone's JetsamEvent reports carry priorities on the scale of their iOS: a real iOS 18.5 report
lists its frontmost app at 100, so the virtual phone's killed foreground app is there too, and kvrig jetsam
reads it as the foreground band, not AGING_BAND1 (10)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrig.reports.jetsam import read_report
from kvrig.virtual.device import SUPPORTED_IOS
from kvrig.virtual.jetsam_report import JetsamVictim, build_report
from kvrig.virtual.state import IOS_BUILDS, Identity

REAL_IOS18 = Path(__file__).parents[1] / "data" / "jetsam" / "JetsamEvent-ios18.5-iPhone14-7-excerpt.ips"


def real_frontmost_priority() -> int:
    text = REAL_IOS18.read_text()
    body = json.loads(text[text.index("\n") :])
    (priority,) = {p["priority"] for p in body["processes"] if "frontmost" in p["states"]}
    return int(priority)


@pytest.mark.parametrize("ios", [v for v in SUPPORTED_IOS if int(v.split(".")[0]) >= 16])
def test_the_foreground_app_is_at_the_real_foreground_priority(ios: str, tmp_path: Path) -> None:
    phone = Identity(
        udid="00008130-0000000000000001",
        serial_number="X",
        product_type="iPhone16,1",
        marketing_name="iPhone 15 Pro",
        product_version=ios,
        build_version=IOS_BUILDS[ios],
        hardware_model="D83AP",
        chip_id=0x8130,
        ecid=1,
        device_name="virtual",
        wifi_mac="00:00:00:00:00:01",
        limit_bytes=3 << 30,
        page_size=16384,
    )
    victim = JetsamVictim(pid=400, name="SmolLM2Demo", rpages=9000, lifetime_max_pages=9000, uuid="U", coalition=400,
                          age_s=60.0, cpu_time_s=30.0)  # fmt: skip
    path = tmp_path / "JetsamEvent.ips"
    path.write_text(build_report(phone=phone, victim=victim))
    (killed,) = read_report(path).killed
    assert killed.priority == real_frontmost_priority() == 100
    assert killed.priority_band is not None and killed.priority_band.startswith("FOREGROUND")
