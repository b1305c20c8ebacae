"""Selecting phones: the lab's devices matched against the phones found on every usbmuxd host, then the
share of this runner (`--shard K/N`, `--devices`).

Shards split by phone with rendezvous (highest-random-weight) hashing on the UDID: a phone goes to the shard
whose sha256(shard number, UDID) is highest. A phone's shard depends only on its UDID and N, so adding a
phone never moves another one, and one phone is never driven by two shards.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvrig.device.discovery import DeviceInfo
from kvrig.exceptions import LabShardError
from kvrig.profiles import load_profile
from kvrig.schemas.lab import ANY_DEVICE, Lab, LabDevice
from kvrig.schemas.results import udid_key


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, sep, count = text.partition("/")
        try:
            shard = cls(int(index), int(count))
        except ValueError:
            shard = None
        if not sep or shard is None or not 1 <= shard.index <= shard.count:
            raise LabShardError(f"--shard {text!r}: expected K/N with 1 <= K <= N, such as 1/2")
        return shard

    def owns(self, udid: str) -> bool:
        return shard_of(udid, self.count) == self.index


def shard_of(udid: str, count: int) -> int:
    """The shard (1..count) that drives this phone."""
    key = udid_key(udid)

    def weight(k: int) -> int:
        return int.from_bytes(hashlib.sha256(f"{k}:{key}".encode()).digest()[:8], "big")

    return max(range(1, count + 1), key=weight)


@dataclass
class Target:
    udid: str
    spec: LabDevice
    info: DeviceInfo | None
    problem: str | None = None  # why its runs cannot be made

    @property
    def host(self) -> str | None:
        return self.info.host if self.info else None


def _profile_name(ref: str) -> str:
    return load_profile(ref).name


def select_targets(
    lab: Lab, attached: list[DeviceInfo], *, shard: Shard | None = None, devices: list[str] | None = None
) -> list[Target]:
    """The lab's devices matched against the attached ones: listed UDIDs (attached or not, so a missing phone
    shows up in the results), then every other attached phone for each `any` entry; then this runner's share:
    the phones of `shard`, and of those only the UDIDs in `devices` (a UDID there that is not attached is
    reported missing when the lab would take it)."""
    mine = {udid_key(u) for u in devices} if devices else None

    def wanted(udid: str) -> bool:
        return (shard is None or shard.owns(udid)) and (mine is None or udid_key(udid) in mine)

    by_udid = {udid_key(d.udid): d for d in attached}
    listed = {udid_key(d.udid) for d in lab.devices if d.udid != ANY_DEVICE}
    targets: list[Target] = []
    taken: set[str] = set()
    for spec in lab.devices:
        expected = _profile_name(spec.profile) if spec.profile else None
        if spec.udid != ANY_DEVICE:
            if not wanted(spec.udid):
                continue
            info = by_udid.get(udid_key(spec.udid))
            problem = None
            if info is None:
                problem = f"device {spec.udid} is not attached"
            elif info.error:
                problem = info.error
            elif expected and info.profile != expected:
                problem = f"expected profile {expected}, the device ({info.product_type}) maps to {info.profile}"
            targets.append(Target(spec.udid, spec, info, problem))
            taken.add(spec.udid)
            continue
        for info in attached:
            if udid_key(info.udid) in listed or info.udid in taken or not wanted(info.udid):
                continue
            if expected and info.profile != expected:
                continue
            targets.append(Target(info.udid, spec, info, info.error))
            taken.add(info.udid)
        # A phone this runner was told it holds, that the `any` entry would take, but that is not attached.
        keys = {udid_key(t.udid) for t in targets}
        for udid in devices or []:
            key = udid_key(udid)
            if key in keys or key in listed or (shard is not None and not shard.owns(udid)):
                continue
            if not expected:
                targets.append(Target(udid, spec, None, f"device {udid} is not attached"))
                keys.add(key)
    return targets
