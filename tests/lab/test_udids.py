"""Two phones of one model share the chip id that starts their UDID (`00008130-…` on every iPhone 15 Pro):
names, run ids and report rows tell them apart by the ECID after it."""

from __future__ import annotations

from kvrig.lab.model import new_run
from kvrig.lab.report import run_name
from kvrig.pytest_plugin import Phone
from kvrig.schemas.lab import MatrixEntry, SchemeSpec
from kvrig.schemas.results import DeviceRef, short_udid

# two iPhone 15 Pros (chip id 0x8130) and an older 40-hex UDID
PRO_A, PRO_B = "00008130-001A2C3E0C38001E", "00008130-000C4D1A3E90802E"
LEGACY = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"


def test_the_short_form_keeps_what_differs() -> None:
    assert short_udid(PRO_A) == "001A2C3E0C38001E" and short_udid(PRO_B) == "000C4D1A3E90802E"
    assert short_udid(LEGACY) == LEGACY[:12]


def test_runs_and_report_names_of_two_pros_differ() -> None:
    entry = MatrixEntry.model_validate({"name": "grow", "app_id": "com.example.app", "schemes": ["fp16"]})
    scheme = SchemeSpec(name="fp16")
    runs = [
        new_run(entry, scheme, DeviceRef(udid=u, profile="iphone-15-pro"), "20261201T000000") for u in (PRO_A, PRO_B)
    ]
    ids = [r.result.run_id for r in runs]
    assert ids[0] != ids[1] and all(short_udid(u) in i for u, i in zip((PRO_A, PRO_B), ids, strict=True))
    names = [run_name(r.result) for r in runs]
    assert names[0] != names[1]
    assert str(Phone(PRO_A, "mini", None, None)) != str(Phone(PRO_B, "mini", None, None))
