"""Device profiles: what a phone or iPad offers an app (RAM, jetsam limits, bandwidth, page size).

One YAML file per device under `device_profiles/` (shipped in the wheel as `kvrig/_data/device_profiles`).
Every number is a sourced value, `{value, basis, source}`, so a plan can say how much to trust it.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StrictInt, ValidationError, model_validator

from kvrig.exceptions import ProfileError
from kvrig.fileio import read_data
from kvrig.schemas import StrictModel, describe_validation_error

PRODUCT_TYPE_RE = re.compile(r"^(iPhone|iPad)\d+,\d+$")
ProductType = Annotated[str, Field(pattern=PRODUCT_TYPE_RE.pattern, description="hw.machine, e.g. iPhone16,1")]

Basis = Literal["measured", "derived", "estimated", "reported", "published"]
"""measured: seen on a device (jetsam report, os_proc_available_memory); derived: computed from measured or
published facts; estimated: our reasoned guess (reasoning in `source`); reported: a third party says so
(press, Xcode data, leaks); published: the vendor's own specification."""

_PACKAGE_DIR = Path(__file__).resolve().parent
# Installed wheel first, then the repository's top-level folder (source checkout, editable install).
PROFILE_DIRS = (_PACKAGE_DIR / "_data" / "device_profiles", _PACKAGE_DIR.parent / "device_profiles")


INCREASED_MEMORY_LIMIT = "com.apple.developer.kernel.increased-memory-limit"
"""The entitlement an app declares for the entitled limit (kvrig app's projects declare it)."""


class _Frozen(StrictModel):
    model_config = ConfigDict(frozen=True)


class SourcedInt(_Frozen):
    value: StrictInt = Field(gt=0, le=1 << 50)  # bytes, counts: a petabyte is no phone's (a typo, or 1e29)
    basis: Basis
    source: str = Field(min_length=1, description="the evidence or the reasoning behind the value")


class SourcedText(_Frozen):
    value: str = Field(min_length=1)
    basis: Basis
    source: str = Field(min_length=1)


class AppMemoryLimit(_Frozen):
    default_bytes: SourcedInt = Field(description="foreground jetsam limit without entitlements")
    entitled_bytes: SourcedInt | None = Field(
        default=None, description="with com.apple.developer.kernel.increased-memory-limit; null: unknown"
    )


class GpuLimits(_Frozen):
    """Metal's own limits, which bind besides jetsam: the GPU working set Metal recommends and the largest
    single buffer it will allocate. null: not known for this device."""

    recommended_working_set_bytes: SourcedInt | None = Field(
        default=None, description="MTLDevice.recommendedMaxWorkingSetSize"
    )
    max_buffer_bytes: SourcedInt | None = Field(default=None, description="MTLDevice.maxBufferLength")


class MappedMemoryLimit(_Frozen):
    """How much of files a process may map (weights mapped read-only count here, not in the footprint)."""

    default_bytes: SourcedInt = Field(description="without entitlements")
    entitled_bytes: SourcedInt | None = Field(
        default=None, description="with com.apple.developer.kernel.increased-memory-limit (a lower bound)"
    )


# The one public measurement of the ceiling (the same probe on one phone): a device profile may carry its own.
MAPPED_MEMORY_LIMIT = MappedMemoryLimit(
    default_bytes=SourcedInt(
        value=6_979_321_856,
        basis="estimated",
        source="measured ~6.5 GiB on an iPhone 13 (repeated read-only MAP_SHARED maps of one weight file until "
        "ENOMEM, github.com/cactus-compute/cactus/issues/793); assumed for every device: a VM policy, not RAM. "
        "Two reports of a 3.1 GB map failing (iPhone 15 Pro, iPhone 16: DenisovAV/flutter_gemma#88, #132) "
        "say it can be lower",
    ),
    entitled_bytes=SourcedInt(
        value=49_392_123_904,
        basis="estimated",
        source="measured > 46 GiB on an iPhone 13 with the increased-memory-limit entitlement "
        "(github.com/cactus-compute/cactus/issues/793); a lower bound, assumed for every device",
    ),
)


class RamVariant(_Frozen):
    """A configuration of the same product sold with another amount of RAM under the same ProductTypes (the iPad
    Pro's 1 TB and 2 TB models): its RAM and its app memory limits, each with its source (`--ram`)."""

    ram_bytes: SourcedInt
    app_memory_limit: AppMemoryLimit
    notes: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> RamVariant:
        _check_limits(self.app_memory_limit, self.ram_bytes.value, "ram_variants")
        return self


def _check_limits(limit: AppMemoryLimit, ram: int, where: str = "") -> None:
    prefix = f"{where}: " if where else ""
    if limit.default_bytes.value > ram:
        raise ValueError(f"{prefix}app_memory_limit.default_bytes exceeds ram_bytes")
    entitled = limit.entitled_bytes.value if limit.entitled_bytes is not None else None
    if entitled is not None and not limit.default_bytes.value <= entitled <= ram:
        raise ValueError(f"{prefix}app_memory_limit.entitled_bytes must lie between default_bytes and ram_bytes")


GIB = 1 << 30
RAM_SUFFIX_RE = re.compile(r"^(?P<ref>.+?)@(?P<gb>\d+)\s*GB$", re.IGNORECASE)
"""A device reference with its RAM: `iPad16,3@16GB`, `ipad-pro-11-m4@16gb` (what `--ram 16` adds)."""


class DeviceProfile(_Frozen):
    schema_version: Literal[1, 2] = Field(alias="schema")
    name: str = Field(pattern=r"^[a-z0-9]+(-[a-z0-9]+)*$", description="kebab-case; the file name")
    marketing_name: str = Field(min_length=1)
    product_types: list[ProductType] = Field(min_length=1)
    chip: str = Field(min_length=1)
    ram_bytes: SourcedInt
    gpu_cores: SourcedInt | None = None
    memory_bandwidth_bytes_per_s: SourcedInt
    page_size_bytes: SourcedInt
    app_memory_limit: AppMemoryLimit
    app_baseline_bytes: SourcedInt = Field(
        description="footprint of the MLX-Swift SwiftUI app before weights and KV (Metal, runtime, UI)"
    )
    os_seen: SourcedText | None = Field(default=None, description="OS versions the limits were seen on")
    gpu: GpuLimits | None = Field(default=None, description="Metal's limits (working set, largest buffer)")
    mapped_memory_limit: MappedMemoryLimit = Field(
        default=MAPPED_MEMORY_LIMIT, description="files a process may map (default: the one public measurement)"
    )
    ram_variants: list[RamVariant] = Field(
        default_factory=list,
        description="schema 2: the same ProductTypes sold with other RAM (chosen with --ram / REF@NGB); "
        "the profile's own fields describe the base configuration",
    )
    notes: list[str] = Field(default_factory=list)
    sources: list[str] = Field(default_factory=list, description="references behind the values")

    @model_validator(mode="after")
    def _consistent(self) -> DeviceProfile:
        _check_limits(self.app_memory_limit, self.ram)
        if self.ram_variants and self.schema_version < 2:
            raise ValueError("ram_variants is a schema-2 field")
        sizes = [self.ram, *(v.ram_bytes.value for v in self.ram_variants)]
        if len(set(sizes)) != len(sizes):
            raise ValueError("ram_variants: each RAM size once, none the base configuration's")
        return self

    @property
    def ram_sizes_gb(self) -> list[int]:
        """The RAM sizes this product was sold with, in GB (this profile's configuration first)."""
        return [self.ram // GIB, *(v.ram_bytes.value // GIB for v in self.ram_variants)]

    def with_ram(self, gb: int) -> DeviceProfile:
        """The profile of the configuration with `gb` GB of RAM (itself for the base configuration)."""
        if gb == self.ram // GIB:
            return self
        variant = next((v for v in self.ram_variants if v.ram_bytes.value == gb * GIB), None)
        if variant is None:
            sizes = ", ".join(f"{n} GB" for n in self.ram_sizes_gb)
            raise ProfileError(
                f"{self.marketing_name} ({self.name}) has no {gb} GB configuration",
                field="ram",
                expected=f"one of {sizes}"
                if len(self.ram_sizes_gb) > 1
                else f"{sizes}, the only RAM size known for it",
            )
        # The base configuration becomes a variant in turn, so the profile still names every size it was sold with.
        base = RamVariant(ram_bytes=self.ram_bytes, app_memory_limit=self.app_memory_limit)
        others = [base, *(v for v in self.ram_variants if v is not variant)]
        return self.model_copy(
            update={
                "ram_bytes": variant.ram_bytes,
                "app_memory_limit": variant.app_memory_limit,
                "ram_variants": others,
                "notes": [f"{gb} GB configuration (--ram {gb})", *variant.notes, *self.notes],
            }
        )

    # Plain numbers for the planner (bytes, bytes/s).
    @property
    def ram(self) -> int:
        return self.ram_bytes.value

    @property
    def memory_bandwidth(self) -> float:
        return float(self.memory_bandwidth_bytes_per_s.value)

    @property
    def page_size(self) -> int:
        return self.page_size_bytes.value

    @property
    def limit_default(self) -> int:
        return self.app_memory_limit.default_bytes.value

    @property
    def limit_entitled(self) -> int | None:
        entitled = self.app_memory_limit.entitled_bytes
        return entitled.value if entitled is not None else None

    @property
    def baseline(self) -> int:
        return self.app_baseline_bytes.value

    @property
    def gpu_working_set(self) -> int | None:
        limit = self.gpu.recommended_working_set_bytes if self.gpu else None
        return limit.value if limit is not None else None

    def mapped_ceiling(self, limit: str) -> int:
        """The mapped-memory ceiling for the `default` or `entitled` limit kind."""
        m = self.mapped_memory_limit
        return m.entitled_bytes.value if limit == "entitled" and m.entitled_bytes is not None else m.default_bytes.value

    @property
    def gpu_max_buffer(self) -> int | None:
        limit = self.gpu.max_buffer_bytes if self.gpu else None
        return limit.value if limit is not None else None


def profiles_dir() -> Path:
    for candidate in PROFILE_DIRS:
        if candidate.is_dir():
            return candidate
    looked = ", ".join(str(d) for d in PROFILE_DIRS)
    raise ProfileError(f"no device_profiles folder found (looked in {looked})")


def load_profile_file(path: str | Path) -> DeviceProfile:
    """Reads one profile YAML, naming the file and the field at fault on any error."""
    path = Path(path)
    data = read_data(path, error=ProfileError, kind="yaml", mapping="a mapping of profile fields")
    try:
        return DeviceProfile.model_validate(data)
    except ValidationError as exc:
        raise _profile_error(exc, path) from None


def _profile_error(exc: ValidationError, path: Path) -> ProfileError:
    field, message, expected = describe_validation_error(exc)
    return ProfileError(message, file=path, field=field or None, expected=expected or None)


def list_profiles() -> list[DeviceProfile]:
    """Every shipped profile, iPhones first, then by ProductType (roughly by release)."""
    paths = sorted(profiles_dir().glob("*.yaml"))
    return list(_load_shipped(tuple((p, p.stat().st_mtime_ns) for p in paths)))


@functools.lru_cache(maxsize=4)
def _load_shipped(stamped_paths: tuple[tuple[Path, int], ...]) -> tuple[DeviceProfile, ...]:
    # Keyed on modification times so an edited profile is re-read; the models are frozen, so sharing is safe.
    profiles = []
    for path, _ in stamped_paths:
        profile = load_profile_file(path)
        if profile.name != path.stem:
            raise ProfileError(f"'{profile.name}' does not match the file name", file=path, field="name")
        profiles.append(profile)
    return tuple(sorted(profiles, key=_release_order))


def find_profile_by_product_type(product_type: str) -> DeviceProfile | None:
    wanted = product_type.strip().lower()
    for profile in list_profiles():
        if wanted in (pt.lower() for pt in profile.product_types):
            return profile
    return None


def device_ref(ref: str, ram_gb: int | None) -> str:
    """`ref` naming the configuration with `ram_gb` GB of RAM (`iPad16,3@16GB`); `ref` itself for None."""
    return ref if ram_gb is None else f"{ref}@{ram_gb}GB"


def load_profile(ref: str | Path, ram_gb: int | None = None) -> DeviceProfile:
    """A profile by ProductType (`iPhone16,1`), name (`iphone-15-pro`) or path to a YAML file, optionally with its
    RAM (`iPad16,3@16GB`, or `ram_gb`) for products sold with two RAM sizes under the same ProductTypes."""
    if isinstance(ref, str) and (m := RAM_SUFFIX_RE.match(ref.strip())):
        if ram_gb is not None and ram_gb != int(m["gb"]):
            raise ProfileError(f"'{ref}' names {m['gb']} GB but {ram_gb} GB was asked for", field="ram")
        return load_profile(m["ref"], int(m["gb"]))
    profile = _load_profile(ref)
    return profile if ram_gb is None else profile.with_ram(ram_gb)


def _load_profile(ref: str | Path) -> DeviceProfile:
    if isinstance(ref, Path) or ref.endswith((".yaml", ".yml", ".json")) or "/" in ref:
        return load_profile_file(ref)  # YAML reads JSON too
    ref = ref.strip()
    if re.match(PRODUCT_TYPE_RE.pattern, ref, re.IGNORECASE):
        found = find_profile_by_product_type(ref)
        if found is not None:
            return found
    else:
        found = next((p for p in list_profiles() if p.name == ref.lower()), None)
        if found is not None:
            return found
    if Path(ref).is_file():  # a profile file named without a folder or a .yaml suffix
        return load_profile_file(ref)
    raise ProfileError(_unknown_message(ref), expected="a profile name, a ProductType or a path to a YAML file")


def _unknown_message(ref: str) -> str:
    profiles = list_profiles()
    known = [p.name for p in profiles] + [pt for p in profiles for pt in p.product_types]
    by_lower = {k.lower(): k for k in known}
    close = [by_lower[k] for k in difflib.get_close_matches(ref.lower(), by_lower, n=3, cutoff=0.6)]
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown device profile '{ref}'{hint} (see `kvrig profiles list`)"


def _release_order(profile: DeviceProfile) -> tuple[int, int, int]:
    family, major, minor = re.findall(r"^(\D+)(\d+),(\d+)$", profile.product_types[0])[0]
    return (0 if family == "iPhone" else 1, int(major), int(minor))
