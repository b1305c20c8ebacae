"""Calibration: the planner's estimated terms fitted to measured soaks (`kvrig calibrate`, `plan --calibration`).

Weights and KV bytes are exact; what the soaks measure beyond them (footprint − weights − allocated KV − the
MLX buffer cache the bundle caps) is the app's baseline, fitted per device profile.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field

from kvrig.schemas import StrictModel

CALIBRATION_SCHEMA_VERSION: Final = 1


class CalibrationPoint(StrictModel):
    source: str = Field(description="results file the point came from")
    run_id: str
    scheme: str
    context_tokens: int = Field(ge=0)
    footprint_bytes: int = Field(ge=0, description="phys_footprint the app measured at this context")
    weights_bytes: int = Field(ge=0, description="exact, from the planner")
    kv_bytes: int = Field(ge=0, description="exact allocated KV at this context, from the planner")
    buffer_cache_bytes: int = Field(
        ge=0, description="MLX's buffer cache at this point: measured (telemetry), else the cap the planner counts"
    )
    overhead_bytes: int = Field(description="footprint − weights − KV: everything the planner estimates")
    baseline_bytes: int = Field(description="overhead − buffer cache: this point's baseline")


class ProfileCalibration(StrictModel):
    baseline_bytes: int = Field(description="median of the points' baselines")
    points: int = Field(ge=1)
    spread_bytes: int = Field(ge=0, description="max − min of the points' baselines")
    min_baseline_bytes: int
    max_baseline_bytes: int
    profile_baseline_bytes: int = Field(description="the device profile's estimate, for comparison")
    sources: list[str] = Field(description="results files the points came from")
    measurements: list[CalibrationPoint]


class Calibration(StrictModel):
    schema_version: Literal[1] = Field(default=CALIBRATION_SCHEMA_VERSION, alias="schema")
    tool_version: str
    profiles: dict[str, ProfileCalibration] = Field(description="device profile name → fitted terms")
