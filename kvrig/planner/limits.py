"""A limit the phone stated, for a plan: the limits registry (`kvrig calibrate --limits`) looked up for a
device's ProductType × OS build × entitlement, and handed to the planner over the profile's estimate."""

from __future__ import annotations

from pathlib import Path

from kvrig.exceptions import SchemaError
from kvrig.profiles import PRODUCT_TYPE_RE, DeviceProfile
from kvrig.schemas import load_model_file
from kvrig.schemas.limits import LimitsRegistry, MeasuredLimit


def load_limits(path: str | Path) -> LimitsRegistry:
    """The registry, naming the file and the field at fault."""
    return load_model_file(LimitsRegistry, path, error=SchemaError)


def product_types(device: str, profile: DeviceProfile) -> list[str]:
    """The ProductTypes a `--device` means: the one named, else every one its profile covers."""
    return [device] if PRODUCT_TYPE_RE.match(device) else list(profile.product_types)


def describe(entry: MeasuredLimit, file: str | Path) -> str:
    """One line saying where a measured limit comes from, for the plan's output."""
    entitled = "entitled" if entry.entitled else "not entitled"
    runs = f"{entry.runs} run{'s' if entry.runs != 1 else ''}"
    agree = "" if len(entry.seen_bytes) == 1 else f", runs disagree: {', '.join(map(str, entry.seen_bytes))} B"
    version = f" (iOS {entry.os_version})" if entry.os_version else ""
    virtual = ""
    if entry.virtual_sources:  # kept by --include-virtual: what the virtual phone was started with, no phone's
        n = len(entry.virtual_sources)
        virtual = (
            f"; {n} of {entry.runs} from a virtual iPhone or from results that cannot say (a virtual iPhone's limit "
            "is the one it was started with)"
        )
    return f"{file}: {entry.product_type} build {entry.build_version}{version}, {entitled}, {runs}{agree}{virtual}"


def lookup(registry: LimitsRegistry, types: list[str], build: str | None, limit: str) -> MeasuredLimit | None:
    """The measured limit for a plan against `limit` (entitled: an app with the increased-memory-limit
    entitlement; default: one without) on one of `types`, on `build` or the build seen last."""
    return registry.find(types, build, limit == "entitled")
