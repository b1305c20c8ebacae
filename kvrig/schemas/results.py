"""Results: what a soak and the lab report per device × bundle × scheme; `results.json`, `kvrig soak --json`
and `kvrig lab --json`.

A results file is written as the run goes, so a run that fails half-way still leaves what it learned:
`outcome` is None and `error` says which step failed until the run is classified.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

from pydantic import Field, model_validator

from kvrig.schemas import StrictModel
from kvrig.schemas.kvcache import WeightsResidency
from kvrig.schemas.lab import LabRecord
from kvrig.schemas.soakplan import OnCritical

# 2: the tunnel a run used, battery samples, interruptions (tunnel drops) and what was lost.
# 3: how each run held the weights (loaded, or mapped from the bundle's file) and how many bytes it mapped.
# 4: the memory limit the phone stated in its log (with the OS build and the app's entitlement), the evidence of
#    how a run ended, and the ends told apart: jetsam_log, gpu_background, watchdog, vanished; the soak's background
#    steps (issue 26, the same unreleased schema); what the soak plan told the app to do at critical pressure
#    (`on_critical`, issue 22: the lab file sets it per entry).
# 5: whether the phone was kvrig's virtual iPhone (`device.virtual`): calibrate keeps its limit out of the registry.
RESULTS_SCHEMA_VERSION: Final = 5
RESIDENCY_FIELDS: Final = (
    "weights_residency_requested",
    "weights_residency",
    "mapped_weight_bytes",
    "residency_note",
)
SCHEMA_4_FIELDS: Final = ("stated_limit", "evidence", "background", "on_critical")
RESULTS_FILE = "results.json"

Outcome = Literal[
    "completed",
    "jetsam",
    "jetsam_log",
    "gpu_background",
    "watchdog",
    "crash",
    "vanished",
    "hang",
    "device_lost",
    "error",
    "allocation_failed",
]
"""How a run ended. `jetsam`: killed by jetsam, its JetsamEvent report pulled; `jetsam_log`: killed by jetsam as the
device log says, with no report filed (a kill while suspended files none); `gpu_background`: aborted for submitting
GPU work from the background; `watchdog`: killed by the watchdog (0x8badf00d); `crash`: died with a crash report;
`vanished`: gone with no end record, no report and nothing in the log. `error` / `allocation_failed`: the app ended
itself with that reason in its end record (it failed)."""
SCHEMA_4_OUTCOMES: tuple[Outcome, ...] = ("jetsam_log", "gpu_background", "watchdog", "vanished")
JETSAM_OUTCOMES: tuple[Outcome, ...] = ("jetsam", "jetsam_log")
"""A memory kill: the context the app survived before it is the measurement a soak is for."""
BAD_OUTCOMES: tuple[Outcome, ...] = tuple(o for o in get_args(Outcome) if o != "completed" and o not in JETSAM_OUTCOMES)
"""Outcomes that fail a soak (non-zero exit) and a lab run; `completed` and the jetsam kills are what a soak is
for (`jetsam_log` still exits non-zero from `kvrig soak`: its footprint at the kill is unknown)."""


class DeviceRef(StrictModel):
    udid: str
    product_type: str | None = None
    os_version: str | None = None
    profile: str | None = Field(default=None, description="our device profile for the ProductType")
    build_version: str | None = Field(default=None, description="the OS build, e.g. 23A341 (schema 4)")
    host: str | None = Field(default=None, description="the usbmuxd host the phone was reached through (lab)")
    virtual: bool = Field(
        default=False, description="kvrig's virtual iPhone: its limit is the one it was started with, not a phone's"
    )


class TpsPoint(StrictModel):
    context_tokens: int = Field(ge=0)
    t: float | None = Field(
        default=None, description="when the app wrote this step (its clock, seconds since the Unix epoch)"
    )
    decode_tps: float | None = Field(default=None, ge=0)
    prefill_tps: float | None = Field(default=None, ge=0)
    phys_footprint_bytes: int | None = Field(default=None, ge=0)


class Prediction(StrictModel):
    """What the planner predicted for this device and scheme (optional until plan and soak are joined)."""

    max_context: int | None = Field(default=None, ge=0)
    limit_bytes: int | None = Field(default=None, ge=0)
    footprint_at_max_context_bytes: int | None = Field(default=None, ge=0)
    limit_source: str | None = Field(
        default=None,
        description="where limit_bytes comes from and why that one: `measured: <limits registry entry>` (a limit "
        "the phone stated), `lab file: limit_bytes`, or the device profile's default or entitled limit, with the "
        "reason (the app declares increased-memory-limit or not, or the lab file's plan.limit); None: the device "
        "profile's, in files written before it said so (schema 4)",
    )


class TunnelRef(StrictModel):
    """The tunnel a run's developer services went through (iOS 17+), or "lockdown" before iOS 17."""

    kind: Literal["lockdown", "userspace", "tunneld"]
    mode: str = Field(description="what was asked: auto, userspace, tunneld[=HOST:PORT]")
    reason: str = Field(description="why this kind (auto says which it chose and why)")
    tunneld: str | None = Field(default=None, description="HOST:PORT of the tunneld used")
    opened: int = Field(default=0, ge=0, description="times it was opened: 1, plus one per reopen after a drop")


class BatterySample(StrictModel):
    """One diagnostics-relay read of IORegistry AppleSmartBattery during the run."""

    t: float = Field(description="seconds since the Unix epoch (host clock)")
    temperature_c: float | None = Field(default=None, description="battery temperature, degrees Celsius")
    level_percent: float | None = Field(default=None, ge=0)
    charging: bool | None = None
    external_power: bool | None = None


class Interruption(StrictModel):
    """The link to the phone broke during the run; resumed or not."""

    t: float = Field(description="when it was noticed, seconds since the Unix epoch")
    cause: Literal["tunnel", "device"] = Field(description="tunnel: the phone stayed attached; device: it went away")
    resumed: bool
    after_s: float | None = Field(default=None, ge=0, description="seconds until the run resumed")
    app_running: bool | None = Field(default=None, description="os_trace's process list after it came back")


class BackgroundStep(StrictModel):
    """A soak step that sent the app to the background (`--background`): another app launched through process
    control, then the app brought back; what the app did and how that ended."""

    requested: Literal["prefill", "decode"] = Field(description="the phase the step aimed at")
    sent: float | None = Field(default=None, description="when the other app was launched, seconds since the epoch")
    returned: float | None = Field(default=None, description="when the app was brought back (None: it was gone)")
    context_tokens: int | None = Field(default=None, ge=0, description="the app's context when it was sent away")
    during: Literal["prefill", "decode", "idle"] | None = Field(
        default=None, description="the phase the app said it was about to submit (its scene record)"
    )
    gpu: Literal["paused", "continued"] | None = Field(
        default=None, description="paused its GPU work, or continued under a continued-processing task (iOS 26+)"
    )
    result: Literal["resumed", "ended_cleanly", "killed_gpu_background", "killed", "not_sent", "unknown"]
    evidence: str = ""


def udid_key(udid: str) -> str:
    """One phone's UDID however a host spells it: usbmuxd2 and old Linux usbmuxd drop the hyphen of the 25-character
    form, tunneld and lab files keep it (pymobiledevice3's usbmux matches them the same way)."""
    return udid.replace("-", "").upper()


def short_udid(udid: str) -> str:
    """What tells two phones apart at a glance: the ECID of a `0000XXXX-ECID` UDID (the chip id before the dash
    is the same on every phone of a model), else the first 12 characters of an older 40-hex UDID."""
    chip, sep, ecid = udid.partition("-")
    return ecid if sep and len(chip) == 8 and ecid else udid[:12]


class StatedLimit(StrictModel):
    """The memory limit the phone stated for the app in its log (runningboardd's `Memory Limits` line at launch,
    the kernel's `exceeded mem limit` line at a kill), keyed as the limits registry keys it."""

    product_type: str | None = Field(description="ProductType of the phone that stated it")
    os_version: str | None = None
    build_version: str | None = Field(description="the OS build: limits move between point releases")
    entitled: bool | None = Field(
        description="the app had com.apple.developer.kernel.increased-memory-limit (None: the phone did not say)"
    )
    active_bytes: int | None = Field(default=None, ge=0, description="`Memory Limits: active N` (MiB) at launch")
    inactive_bytes: int | None = Field(default=None, ge=0, description="`inactive N` (MiB): the limit in background")
    exceeded_bytes: int | None = Field(
        default=None, ge=0, description="`exceeded mem limit: <kind> N MB` at the kill (the limit the kernel applied)"
    )
    exceeded_kind: str | None = Field(default=None, description="ActiveHard, InactiveHard, ...")
    lines: list[str] = Field(default_factory=list, description="the log lines these numbers were read from")

    @property
    def limit_bytes(self) -> int | None:
        """The foreground limit: the one launch states, else the one the kernel killed at."""
        return self.active_bytes if self.active_bytes is not None else self.exceeded_bytes


class Evidence(StrictModel):
    """One thing seen that says how the run ended."""

    kind: Literal["jetsam_report", "crash_report", "log", "telemetry", "none"]
    detail: str = Field(description="what it says")
    file: str | None = Field(default=None, description="the pulled report, relative to the results file")
    line: str | None = Field(default=None, description="the device-log line, as the phone sent it")


class SoakFiles(StrictModel):
    """Files pulled into the output folder, relative to the results file's folder."""

    telemetry: str | None = None
    jetsam_reports: list[str] = Field(default_factory=list)
    crash_reports: list[str] = Field(default_factory=list)
    skipped_reports: list[str] = Field(
        default_factory=list,
        description="reports the phone listed that were not pulled, each with why (not a file, gone, too large)",
    )


class Confirmation(StrictModel):
    """A threshold-search run: the same plan again, stopped at the last context that survived."""

    run_id: str
    max_tokens: int = Field(ge=0, description="the context it was asked to reach")
    outcome: Outcome | None = None
    max_context_reached: int | None = Field(default=None, ge=0)
    folder: str | None = Field(default=None, description="its files, relative to the results file")


class GateCheck(StrictModel):
    """One lab gate evaluated on one run."""

    gate: str = Field(description="min_max_safe_context, min_decode_tps_at[<context>] or max_predicted_error")
    status: Literal["passed", "failed", "not_evaluated"]
    threshold: float = Field(allow_inf_nan=False)
    measured: float | None = None
    message: str


class SoakResult(StrictModel):
    run_id: str
    device: DeviceRef
    app_id: str
    process: str | None = Field(default=None, description="the app's process name (CFBundleExecutable)")
    bundle: str | None = Field(default=None, description="the model bundle the app ran")
    scheme: str
    backend: Literal["mlx", "coreml"] = Field(
        default="mlx", description="the runtime soaked: the plan's, then what the app's start record says ran"
    )
    weights_residency_requested: WeightsResidency | None = Field(
        default=None,
        description="the residency the soak plan asked for (schema 3; the lab entry's `residencies`); None: as the "
        "bundle says",
    )
    weights_residency: WeightsResidency | None = Field(
        default=None,
        description="how the app held the weights, from its start record (schema 3; None: not said: an app that "
        "predates it, or one that died before its start record)",
    )
    mapped_weight_bytes: int | None = Field(
        default=None, ge=0, description="weight bytes the app mapped from the bundle's file (its start record)"
    )
    residency_note: str | None = Field(
        default=None, description="why the app loaded the weights although mapping was asked for (its start record)"
    )
    on_critical: OnCritical | None = Field(
        default=None,
        description="what the soak plan told the app to do at critical memory pressure (schema 4; `kvrig soak "
        "--on-critical`, the lab file's `on_critical`): stop_and_save, or continue into jetsam; None: not recorded",
    )
    entry: str | None = Field(default=None, description="the lab matrix entry this run belongs to")
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
    confirmations: list[Confirmation] = Field(default_factory=list, description="threshold-search runs (lab)")
    gates: list[GateCheck] = Field(default_factory=list, description="lab gates evaluated on this run")
    tunnel: TunnelRef | None = Field(default=None, description="the tunnel used (None: not recorded)")
    battery: list[BatterySample] = Field(
        default_factory=list, description="battery temperature, level and charging state every few seconds"
    )
    interruptions: list[Interruption] = Field(default_factory=list, description="tunnel drops and unplugs")
    background: list[BackgroundStep] = Field(
        default_factory=list, description="the app sent to the background during the run, and what came of it"
    )
    lost: Literal["tunnel", "device"] | None = Field(
        default=None, description="for outcome device_lost: whether the tunnel or the whole phone did not come back"
    )
    stated_limit: StatedLimit | None = Field(
        default=None, description="the limit the phone stated in its log (schema 4; None: it said none we read)"
    )
    evidence: list[Evidence] = Field(default_factory=list, description="what says how the run ended (schema 4)")
    steps_done: list[str] = Field(default_factory=list, description="driver steps that completed, in order")
    error: str | None = Field(default=None, description="the step that failed and why (partial results)")

    @property
    def variant(self) -> str:
        """The scheme, with the residency the run asked for when it asked: what tells one entry's runs apart."""
        asked = self.weights_residency_requested
        return f"{self.scheme}/{asked}" if asked else self.scheme


class ResultsFile(StrictModel):
    schema_version: Literal[1, 2, 3, 4, 5] = Field(default=RESULTS_SCHEMA_VERSION, alias="schema")  # 1-4 still read
    tool_version: str
    runs: list[SoakResult]
    lab: LabRecord | None = Field(default=None, description="the lab (and shard) these runs belong to")

    @model_validator(mode="after")
    def _residency_needs_schema_3(self) -> ResultsFile:
        if self.schema_version < 3:
            for i, run in enumerate(self.runs):
                found = [name for name in RESIDENCY_FIELDS if getattr(run, name) is not None]
                if found:
                    raise ValueError(f"runs.{i}: {found} are schema-3 fields; an older file cannot carry them")
        if self.schema_version < 4:
            for i, run in enumerate(self.runs):
                found = [name for name in SCHEMA_4_FIELDS if getattr(run, name)]  # None and [] are every schema's
                found += ["device.build_version"] if run.device.build_version is not None else []
                found += ["predicted.limit_source"] if run.predicted and run.predicted.limit_source else []
                found += [f"outcome {run.outcome}"] if run.outcome in SCHEMA_4_OUTCOMES else []
                found += [f"confirmation {c.outcome}" for c in run.confirmations if c.outcome in SCHEMA_4_OUTCOMES]
                if found:
                    raise ValueError(f"runs.{i}: {found} are schema 4's; an older file cannot carry them")
            if self.lab is not None and self.lab.outcomes:
                raise ValueError("lab.outcomes is schema 4's; an older file cannot carry it")
        if self.schema_version < 5:
            for i, run in enumerate(self.runs):
                if run.device.virtual:
                    raise ValueError(f"runs.{i}: device.virtual is schema 5's; an older file cannot carry it")
        return self
