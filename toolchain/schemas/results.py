"""Results: what a soak (and later the lab) reports per device × bundle × scheme; `results.json` and
`kvrig soak --json`.

A results file is written as the run goes, so a run that fails half-way still leaves what it learned:
`outcome` is None and `error` says which step failed until the run is classified.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field

from toolchain.schemas import StrictModel

RESULTS_SCHEMA_VERSION: Final = 1
RESULTS_FILE = "results.json"

Outcome = Literal["completed", "jetsam", "crash", "hang", "device_lost"]


class DeviceRef(StrictModel):
    udid: str
    product_type: str | None = None
    os_version: str | None = None
    profile: str | None = Field(default=None, description="our device profile for the ProductType")


class TpsPoint(StrictModel):
    context_tokens: int = Field(ge=0)
    decode_tps: float | None = Field(default=None, ge=0)
    prefill_tps: float | None = Field(default=None, ge=0)
    phys_footprint_bytes: int | None = Field(default=None, ge=0)


class Prediction(StrictModel):
    """What the planner predicted for this device and scheme (optional until plan and soak are joined)."""

    max_context: int | None = Field(default=None, ge=0)
    limit_bytes: int | None = Field(default=None, ge=0)
    footprint_at_max_context_bytes: int | None = Field(default=None, ge=0)


class SoakFiles(StrictModel):
    """Files pulled into the output folder, relative to it."""

    telemetry: str | None = None
    jetsam_reports: list[str] = Field(default_factory=list)
    crash_reports: list[str] = Field(default_factory=list)


class SoakResult(StrictModel):
    run_id: str
    device: DeviceRef
    app_id: str
    process: str | None = Field(default=None, description="the app's process name (CFBundleExecutable)")
    bundle: str | None = Field(default=None, description="the model bundle the app ran")
    scheme: str
    outcome: Outcome | None = Field(default=None, description="None while running or when a step failed")
    outcome_detail: str | None = None
    max_context_reached: int | None = Field(default=None, ge=0, description="largest context in a step record")
    max_safe_context: int | None = Field(
        default=None, ge=0, description="largest context the app measured and survived (this run)"
    )
    max_safe_context_confirmed: bool = Field(
        default=False, description="confirmed by a repeat run at that context (threshold search)"
    )
    footprint_at_kill_bytes: int | None = Field(default=None, ge=0, description="from the JetsamEvent report")
    limit_bytes: int | None = Field(default=None, ge=0, description="limit implied by the JetsamEvent report")
    app_limit_bytes: int | None = Field(default=None, ge=0, description="limit the app believed (start record)")
    last_footprint_bytes: int | None = Field(default=None, ge=0, description="last footprint the app wrote")
    tps_curve: list[TpsPoint] = Field(default_factory=list)
    predicted: Prediction | None = None
    started: float | None = Field(default=None, description="seconds since the Unix epoch")
    finished: float | None = None
    files: SoakFiles = Field(default_factory=SoakFiles)
    steps_done: list[str] = Field(default_factory=list, description="driver steps that completed, in order")
    error: str | None = Field(default=None, description="the step that failed and why (partial results)")


class ResultsFile(StrictModel):
    schema_version: Literal[1] = Field(default=RESULTS_SCHEMA_VERSION, alias="schema")
    tool_version: str
    runs: list[SoakResult]
