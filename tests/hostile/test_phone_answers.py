"""A phone whose lockdownd answers break the protocol (defect 4 of issue 24): a ProductType that is a number or
a dictionary, a ProductVersion of bytes or 5000 digits, device values cut off mid-plist or not a dictionary.
That phone is listed with what is wrong (DeviceAnswerError, exit 33 when it is used); the phone beside it is
listed and used as if nothing happened."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrig.virtual.faults import FaultPlan
from tests.hostile.conftest import BUNDLE_ID, Emulator, emulator, kvrig
from tests.hostile_suite import hostile

__all__ = ["emulator"]

MALFORMED: dict[str, dict[str, Any]] = {
    "ProductType a number": {"lockdown_values": {"ProductType": 7}},
    "ProductType a dictionary": {"lockdown_values": {"ProductType": {"iPhone16,1": True}}},
    "ProductVersion bytes": {"lockdown_values": {"ProductVersion": b"17.4"}},
    "ProductVersion of 5000 digits": {"lockdown_values": {"ProductVersion": "9" * 5000}},
    "device values cut off mid-plist": {"lockdown_garbage": "truncated"},
    "device values a plist array": {"lockdown_garbage": "array"},
}


@pytest.fixture()
def malformed(emulator: Emulator) -> Iterator[Emulator]:
    """The 17.4 phone misbehaves; the 16.7 one beside it does not."""
    yield emulator
    emulator.ios17.faults = FaultPlan()


@pytest.mark.parametrize("how", list(MALFORMED))
@hostile(4, "one phone's lockdownd answers are malformed", "kvrig devices: exit 0, both listed")
def test_a_malformed_phone_is_listed_with_why_beside_the_healthy_one(malformed: Emulator, how: str) -> None:
    bad = malformed.ios17
    bad.faults = FaultPlan(**MALFORMED[how])
    ran = kvrig("devices", "--json", timeout=120)
    assert ran.code == 0, ran.stderr
    listed = {d["udid"]: d for d in json.loads(ran.stdout)}
    healthy = listed[malformed.udid]
    assert healthy["product_type"] == "iPhone16,1" and healthy["profile"] == "iphone-15-pro"
    assert healthy["ready"] and healthy["problems"] == []
    broken = listed[bad.identity.udid]
    assert [p["cause"] for p in broken["problems"]] == ["DeviceAnswerError"] and not broken["ready"]
    assert [p["exit_code"] for p in broken["problems"]] == [33]
    assert broken["product_type"] in (None, "iPhone16,1")  # a wrong value is never passed on
    assert all(isinstance(broken[key], str | None) for key in ("os_version", "name", "build_version"))


@hostile(4, "a soak on the phone whose ProductVersion has 5000 digits", "exit 33 naming the phone, in 60 s")
def test_using_the_malformed_phone_is_its_own_error(malformed: Emulator, tmp_path: Path) -> None:
    malformed.ios17.faults = FaultPlan(lockdown_values={"ProductVersion": "9" * 5000})
    udid = malformed.ios17.identity.udid
    ran = kvrig("soak", "--app-id", BUNDLE_ID, "--udid", udid, "--max-tokens", "512", "-o", str(tmp_path / "o"))
    assert ran.code == 33, ran.stderr
    assert f"the device {udid} answered something that is not lockdownd's protocol" in ran.stderr
    assert "Traceback" not in ran.stderr
    assert ran.seconds < 60


@hostile(4, "kvrig virtual start --lockdown-value ProductType=7 (the lie from the command line)", "devices: exit 0")
def test_the_virtual_phone_lies_from_its_command_line(tmp_path: Path) -> None:
    socket = f"/tmp/kvrig-lie-{os.getpid()}.sock"
    env = {"USBMUXD_SOCKET_ADDRESS": socket}
    started = kvrig(
        "virtual", "start", "--socket", socket, "--state", str(tmp_path / "s"), "--detach",
        "--lockdown-value", "ProductType=7", "--claim-size", "telemetry.jsonl=1125899906842624",
        "--phantom-entry", "JetsamEvent-gone.ips", "--json", env=env, timeout=120,
    )  # fmt: skip
    try:
        assert started.code == 0, started.stderr
        faults = json.loads(started.stdout)["faults"]
        assert faults["lockdown_values"] == {"ProductType": 7}
        assert faults["claim_sizes"] == {"telemetry.jsonl": 2**50} and faults["phantom_entries"] == [
            "JetsamEvent-gone.ips"
        ]
        ran = kvrig("devices", "--json", env=env, timeout=120)
        assert ran.code == 0, ran.stderr
        (phone,) = json.loads(ran.stdout)
        assert [p["cause"] for p in phone["problems"]] == ["DeviceAnswerError"] and "ProductType is 7" in phone["error"]
    finally:
        kvrig("virtual", "stop", "--socket", socket, env=env, timeout=120)
