"""Calibration: the planner's estimated terms fitted to measured soaks (`kvrig calibrate`, `plan --calibration`).

Weights and KV bytes are exact; what the soaks measure beyond them (footprint − weights − allocated KV − the
MLX buffer cache the bundle caps) is the app's baseline, fitted per device profile. Weights an app mapped from
the bundle's file are not in its footprint, so a mapped run's point leaves them out of the weights it subtracts.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, model_validator

from kvrig.schemas import StrictModel

# 2: a point records the weight bytes its run mapped (outside the footprint). Schema-1 files still read.
CALIBRATION_SCHEMA_VERSION: Final = 2


class CalibrationPoint(StrictModel):
    source: str = Field(description="results file the point came from")
    run_id: str
    scheme: str
    context_tokens: int = Field(ge=0)
    footprint_bytes: int = Field(ge=0, description="phys_footprint the app measured at this context")
    weights_bytes: int = Field(ge=0, description="exact, from the planner")
    mapped_weight_bytes: int = Field(
        default=0,
        ge=0,
        description="of those, the bytes the run's app mapped from the bundle's file: not in its footprint, so not "
        "subtracted from it (schema 2; 0: loaded)",
    )
    kv_bytes: int = Field(ge=0, description="exact allocated KV at this context, from the planner")
    buffer_cache_bytes: int = Field(
        ge=0, description="MLX's buffer cache at this point: measured (telemetry), else the cap the planner counts"
    )
    overhead_bytes: int = Field(
        description="footprint − (weights − mapped weights) − KV: everything the planner estimates"
    )
    baseline_bytes: int = Field(description="overhead − buffer cache: this point's baseline")


class ProfileCalibration(StrictModel):
    baseline_bytes: int = Field(ge=0, description="median of the points' baselines")
    points: int = Field(ge=1)
    spread_bytes: int = Field(ge=0, description="max − min of the points' baselines")
    min_baseline_bytes: int
    max_baseline_bytes: int
    profile_baseline_bytes: int = Field(description="the device profile's estimate, for comparison")
    sources: list[str] = Field(description="results files the points came from")
    measurements: list[CalibrationPoint]


class Calibration(StrictModel):
    schema_version: Literal[1, 2] = Field(default=CALIBRATION_SCHEMA_VERSION, alias="schema")
    tool_version: str
    profiles: dict[str, ProfileCalibration] = Field(description="device profile name → fitted terms")

    @model_validator(mode="after")
    def _mapped_needs_schema_2(self) -> Calibration:
        if self.schema_version < 2:
            for name, entry in self.profiles.items():
                if any("mapped_weight_bytes" in m.model_fields_set for m in entry.measurements):
                    raise ValueError(f"profiles.{name}: mapped_weight_bytes is a schema-2 field")
        return self
