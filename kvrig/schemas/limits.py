"""The limits registry: the app memory limit each phone stated in its own log, per ProductType × OS build ×
entitlement (`kvrig calibrate --limits limits.json`; `kvrig plan --limits`, `kvrig lab run --limits`,
`kvrig devices --limits` read it). A JSON file a team commits and grows: calibrating again merges new runs in.

Limits move between point releases without a release note (an 8 GB iPad went from about 6 GB to 3 GB in iPadOS
26.4), so an entry holds one OS build; what the phone stated is a measurement, the profile's limit an estimate.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from kvrig.schemas import StrictModel

LIMITS_SCHEMA_VERSION: Final = 1


class MeasuredLimit(StrictModel):
    product_type: str = Field(pattern=r"^(iPhone|iPad)\d+,\d+$", description="hw.machine, e.g. iPhone16,1")
    build_version: str = Field(min_length=1, description="the OS build the phone ran, e.g. 23A341")
    os_version: str | None = Field(default=None, description="the OS version of that build, e.g. 26.0")
    entitled: bool = Field(description="the app had com.apple.developer.kernel.increased-memory-limit")
    limit_bytes: int = Field(gt=0, description="the foreground (active) limit the phone stated, the latest run's")
    inactive_bytes: int | None = Field(default=None, gt=0, description="the limit it stated for the background")
    seen_bytes: list[int] = Field(
        description="every foreground limit the runs stated, smallest first (one value: they agree)", min_length=1
    )
    runs: int = Field(ge=1, description="runs whose log stated it")
    last_seen: float | None = Field(
        default=None, allow_inf_nan=False, description="the latest run's start, seconds since the Unix epoch"
    )
    sources: list[str] = Field(description="RESULTS.json#run_id of each run", min_length=1)
    virtual_sources: list[str] = Field(
        default_factory=list,
        description="the sources from kvrig's virtual iPhone, or from results too old to say (before results schema "
        "5), kept by `kvrig calibrate --include-virtual`: their limit is the one the virtual iPhone was started with; "
        "left out of the file when there are none",
    )

    @model_serializer(mode="wrap")
    def _no_empty_virtual_sources(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A registry of phones only is written as before the field came: a team's older kvrig still reads it.
        data: dict[str, Any] = handler(self)
        if not data.get("virtual_sources"):
            data.pop("virtual_sources", None)
        return data

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.product_type, self.build_version, self.entitled


class LimitsRegistry(StrictModel):
    schema_version: Literal[1] = Field(default=LIMITS_SCHEMA_VERSION, alias="schema")
    tool_version: str
    limits: list[MeasuredLimit] = Field(default_factory=list, description="one per ProductType × build × entitlement")

    @model_validator(mode="after")
    def _one_per_key(self) -> LimitsRegistry:
        seen: set[tuple[str, str, bool]] = set()
        for i, entry in enumerate(self.limits):
            if entry.key in seen:
                raise ValueError(f"limits.{i}: {entry.key} is listed twice (one per ProductType × build × entitled)")
            seen.add(entry.key)
        return self

    def for_phone(self, product_type: str | None, build: str | None) -> dict[str, MeasuredLimit | None]:
        """A phone's measured limits on its OS build, {"entitled": ..., "default": ...} (None where none is)."""
        types = [product_type] if product_type else []
        return {
            kind: self.find(types, build, kind == "entitled") if build is not None else None
            for kind in ("entitled", "default")
        }

    def find(self, product_types: list[str], build: str | None, entitled: bool) -> MeasuredLimit | None:
        """The entry for one of these ProductTypes with this entitlement: on `build`, or (no build given) the one
        seen last, whatever its build."""
        found = [
            e
            for e in self.limits
            if e.product_type in product_types
            and e.entitled == entitled
            and (build is None or e.build_version == build)
        ]
        return max(found, key=lambda e: e.last_seen or 0.0, default=None)
