"""Splitting a lab by phone (no device needed): rendezvous hashing keeps each phone on one shard and moves no
phone when others are added; `--devices` narrows; a bad --shard is exit 42, an --usbmuxd that is no address 51."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvrig.device.discovery import DeviceInfo
from kvrig.device.hosts import UsbmuxHost, parse_host, parse_hosts
from kvrig.exceptions import LabShardError, UsbmuxAddressError
from kvrig.lab.targets import Shard, select_targets, shard_of
from kvrig.schemas.lab import Lab
from tests.lab.conftest import ROOT


def udids(n: int) -> list[str]:
    return [f"00008130-{secrets.randbits(52):016X}" for _ in range(n)]


def test_every_phone_is_in_exactly_one_shard_and_adding_phones_moves_none() -> None:
    phones = udids(200)
    before = {u: shard_of(u, 4) for u in phones}
    assert all(1 <= s <= 4 for s in before.values())
    assert sum(Shard(k, 4).owns(u) for u in phones for k in range(1, 5)) == len(phones)
    assert len(set(before.values())) == 4  # 200 phones reach every shard
    more = phones + udids(50)
    assert {u: shard_of(u, 4) for u in more if u in before} == before
    # the same phone whichever way its serial is spelt
    assert shard_of(phones[0].replace("-", "").lower(), 4) == before[phones[0]]


def test_growing_the_shard_count_moves_only_phones_to_the_new_shard() -> None:
    phones = udids(200)
    moved = [u for u in phones if shard_of(u, 3) != shard_of(u, 4)]
    assert moved and all(shard_of(u, 4) == 4 for u in moved)  # rendezvous: nothing shuffles among the old ones


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b", "1/0", "/2"])
def test_bad_shard_is_refused(text: str) -> None:
    with pytest.raises(LabShardError):
        Shard.parse(text)


def info(udid: str, host: str, profile: str = "iphone-15-pro") -> DeviceInfo:
    return DeviceInfo(udid=udid, connection="USB", product_type="iPhone16,1", profile=profile, host=host)


def lab(devices: list[dict[str, str]]) -> Lab:
    return Lab.model_validate({"schema": 1, "devices": devices, "matrix": [{"app_id": "a", "schemes": ["fp16"]}]})


def test_shard_and_devices_narrow_the_selection() -> None:
    phones = udids(8)
    attached = [info(u, "mini-a" if i % 2 else "mini-b") for i, u in enumerate(phones)]
    any_lab = lab([{"udid": "any"}])
    split = [{t.udid for t in select_targets(any_lab, attached, shard=Shard(k, 2))} for k in (1, 2)]
    assert split[0].isdisjoint(split[1]) and split[0] | split[1] == set(phones)
    mine = select_targets(any_lab, attached, devices=[phones[0], phones[1].lower().replace("-", "")])
    assert [t.udid for t in mine] == phones[:2] and all(t.problem is None for t in mine)
    # a phone this runner should hold but does not see is reported, not skipped
    gone = udids(1)[0]
    missing = select_targets(any_lab, attached, devices=[phones[0], gone])
    assert [(t.udid, t.problem) for t in missing] == [(phones[0], None), (gone, f"device {gone} is not attached")]
    # a listed phone absent from every host is reported only by the shard that owns it
    listed = lab([{"udid": gone}])
    owners = [k for k in (1, 2) if select_targets(listed, attached, shard=Shard(k, 2))]
    assert owners == [shard_of(gone, 2)]


def test_usbmuxd_addresses_parse_with_optional_names() -> None:
    assert parse_host("mini-a=10.0.0.11:27015") == UsbmuxHost("mini-a", "10.0.0.11:27015")
    assert parse_host("127.0.0.1:5000") == UsbmuxHost("127.0.0.1:5000", "127.0.0.1:5000")
    assert parse_host("/var/run/usbmuxd") == UsbmuxHost("/var/run/usbmuxd", "/var/run/usbmuxd")
    assert [h.name for h in parse_hosts(["a=h:1 b=h:2", "c=h:3"])] == ["a", "b", "c"]
    assert parse_hosts([])[0].address is None  # this machine's usbmuxd
    assert parse_host("UNIX:/var/run/usbmuxd").address == "/var/run/usbmuxd"  # libimobiledevice's form
    with pytest.raises(LabShardError):
        parse_host("a=")
    for bad in ("nohostport", "a=h:99999", "a=h:x"):
        with pytest.raises(UsbmuxAddressError):
            parse_host(bad)
    with pytest.raises(LabShardError):
        parse_hosts(["a=h:1", "a=h:2"])


@pytest.mark.parametrize(("args", "code"), [(["--shard", "2/1"], 42), (["--usbmuxd", "not-an-address"], 51)])
def test_cli_refuses_bad_shard_options(args: list[str], code: int, tmp_path: Path) -> None:
    lab_file = tmp_path / "lab.yaml"
    lab_file.write_text(yaml.safe_dump({"schema": 1, "matrix": [{"app_id": "a", "schemes": ["fp16"]}]}))
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "lab", "run", str(lab_file), "-o", str(tmp_path / "o"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and args[0] in proc.stderr


def test_a_lab_file_udid_matches_the_phone_however_usbmuxd_spells_it() -> None:
    """A lab file written with `kvrig devices`' hyphenated UDID, on a host whose usbmuxd drops the hyphen (usbmuxd2,
    old Linux releases): the phone was reported "not attached", and an `any` entry took it a second time."""
    (phone,) = udids(1)
    attached = [info(phone.replace("-", ""), "linux-box")]
    targets = select_targets(lab([{"udid": phone}, {"udid": "any"}]), attached)
    assert [(t.problem, t.info is not None) for t in targets] == [(None, True)]
