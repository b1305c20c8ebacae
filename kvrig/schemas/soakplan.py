"""Soak plan: what the app runs when launched for a soak (a file in the container, named at launch)."""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import AfterValidator, Field, model_validator

from kvrig.schemas import StrictModel
from kvrig.schemas.kvcache import WeightsResidency

OnCritical = Literal["stop_and_save", "continue"]
"""What the app does at critical memory pressure: stop_and_save as its bundle's pressure policy says (kvrig's default
policy stops and saves), or continue: keep growing into the kernel's limit, to find where jetsam kills it."""
BufferCacheMode = Literal["capped", "uncapped"]
"""capped: MLX's buffer cache capped at kvcache.json's buffer_cache_limit_bytes and emptied after an eviction (kvrig's
app); uncapped: the app never sets the cap (MLX's default: its memory limit) nor empties the cache, as an app grown
from mlx-swift-lm's generation loop runs (what `kvrig plan --app uncapped` plans)."""

# 2: `backend` says which runtime the app soaks (mlx, or the Core ML program `kvrig app --coreml` ships).
# 3: `weights_residency` overrides how the app holds the weights (the lab runs one bundle both ways). Apps read
# 2 and 3; an app that knows only 2 refuses a 3 by its schema number instead of the unknown key.
# 4: `buffer_cache` says whether the app caps MLX's buffer cache this run (kvrig's app) or runs as an app that never
# caps nor empties it (`kvrig plan --app uncapped`). Apps read 2 to 4.
SOAKPLAN_SCHEMA_VERSION: Final = 4
SOAKPLAN_FILE = "soakplan.json"
SOAKPLAN_LAUNCH_ARGUMENT = "--kvrig-soak-plan"


MAX_TOKENS: Final = 1 << 30
"""No context reaches it; a count past it is a typo (or 1e30), which the app would take as an endless soak."""


class GrowthSchedule(StrictModel):
    start_tokens: int = Field(ge=1, le=MAX_TOKENS, description="context fed before the first measurement")
    step_tokens: int = Field(ge=1, le=MAX_TOKENS, description="tokens added between measurements")
    max_tokens: int = Field(ge=1, le=MAX_TOKENS, description="stop growing here")
    decode_tokens: int = Field(
        default=16, ge=1, le=MAX_TOKENS, description="tokens generated at each point to measure tok/s"
    )

    @model_validator(mode="after")
    def _starts_below_its_end(self) -> GrowthSchedule:
        if self.start_tokens > self.max_tokens:
            raise ValueError(f"start_tokens {self.start_tokens} is past max_tokens {self.max_tokens}")
        return self


class StopConditions(StrictModel):
    min_decode_tps: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    max_footprint_bytes: int | None = Field(default=None, ge=0)
    max_seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False)


def _file_name_part(value: str) -> str:
    """A run id names files (telemetry, results): no folder separators, no `.` or `..`."""
    if "/" in value or "\x00" in value or value in (".", ".."):
        raise ValueError(f"{value!r} would name another folder (no '/', '.' or '..')")
    return value


def _container_path(value: str) -> str:
    """A file in the app's Documents, where the app writes it and kvrig pulls it from."""
    parts = value.split("/")
    if not value or value.startswith("/") or any(part in ("", ".", "..") for part in parts) or "\x00" in value:
        raise ValueError(f"{value!r} is not a relative path inside the app's Documents (no '..', '.' or '//')")
    return value


class SoakPlan(StrictModel):
    schema_version: Literal[2, 3, 4] = Field(default=SOAKPLAN_SCHEMA_VERSION, alias="schema")
    run_id: Annotated[str, AfterValidator(_file_name_part)] = Field(min_length=1)
    scheme: str
    schedule: GrowthSchedule
    stop: StopConditions = StopConditions()
    text: str = Field(min_length=1, description="fed repeatedly to grow the context")
    telemetry_file: Annotated[str, AfterValidator(_container_path)] = "telemetry.jsonl"
    on_critical: OnCritical = "stop_and_save"
    backend: Literal["mlx", "coreml"] = Field(
        default="mlx", description="the runtime the app soaks: MLX, or KvrigModel.mlpackage (`kvrig app --coreml`)"
    )
    weights_residency: WeightsResidency | None = Field(
        default=None,
        description="how the app holds the weights for this run (schema 3): loaded into MLX's memory, or mapped from "
        "the bundle's file (the app falls back to loading, and says so, where it cannot map); null: as the "
        "bundle's kvcache.json says",
    )
    buffer_cache: BufferCacheMode | None = Field(
        default=None,
        description="MLX's buffer cache this run (schema 4): capped at kvcache.json's buffer_cache_limit_bytes "
        "(kvrig's app), or uncapped and never emptied (an app kvrig did not write); null: capped",
    )

    @model_validator(mode="after")
    def _residency_needs_schema_3(self) -> SoakPlan:
        if self.schema_version < 3 and self.weights_residency is not None:
            raise ValueError("'weights_residency' is a schema-3 field; a schema-2 plan cannot carry it")
        if self.schema_version < 4 and self.buffer_cache is not None:
            raise ValueError(f"'buffer_cache' is a schema-4 field; a schema-{self.schema_version} plan cannot carry it")
        return self
