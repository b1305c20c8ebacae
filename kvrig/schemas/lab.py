"""Lab file: which phones, which app × bundle × scheme matrix, the soak schedule, the threshold search, the
gates CI fails on. YAML (or JSON); paths in it are relative to the file.

    schema: 1
    devices: [{udid: any}]
    matrix:
      - app_id: dev.kvrig.soak
        schemes: [fp16]
        residencies: [loaded, mapped]   # optional: the same bundle both ways, side by side in the report
        soak: {step_tokens: 512, max_tokens: 65536}
        on_critical: continue           # optional: past critical pressure into jetsam (default: the lab's)
    on_critical: stop_and_save          # optional: the lab's default, as `kvrig soak --on-critical`
    gates: {min_max_safe_context: 2048, min_decode_tps_at: {1024: 20}}

Still schema 1: `residencies` is an optional key a person adds to a file, and a lab without it reads and runs
as before; `plan.limit: app` is a new value, the default, and a file's `default` or `entitled` means what it did.
`on_critical` (the lab's and an entry's) is optional too: without it every run stops and saves at critical pressure,
as the soak plan's default always did.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvrig.exceptions import SchemaError
from kvrig.fileio import read_data
from kvrig.schemas import StrictModel, validate_data
from kvrig.schemas.kvcache import WeightsResidency
from kvrig.schemas.soakplan import MAX_TOKENS, OnCritical

ANY_DEVICE = "any"
LimitChoice = Literal["app", "default", "entitled"]


class LabDevice(StrictModel):
    udid: str = Field(min_length=1, description="a UDID, or `any`: every attached device not listed by UDID")
    profile: str | None = Field(
        default=None,
        description="expected device profile (name or ProductType): a UDID that maps elsewhere is an error; "
        "with `any`, only devices with this profile are used; `REF@16GB` plans the 16 GB configuration of a product "
        "sold with two RAM sizes under the same ProductTypes",
    )
    limit_bytes: int | None = Field(
        default=None,
        gt=0,
        description="app memory limit to plan against when it is not the profile's (a virtual iPhone started "
        "with a small limit)",
    )
    baseline_bytes: int | None = Field(
        default=None,
        gt=0,
        description="app footprint before weights and KV to plan against when it is not the profile's estimate "
        "(the virtual iPhone counts 48 MiB)",
    )


class SchemeSpec(StrictModel):
    name: str = Field(min_length=1, description="recorded with the run (the soak plan's scheme)")
    arguments: list[str] = Field(default_factory=list, description="extra launch arguments for the app")
    plan_scheme: str | None = Field(
        default=None, description="the planner's KV scheme for the prediction (default: `name`, if it is one)"
    )


class SoakSchedule(StrictModel):
    start_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS, description="default: step_tokens")
    step_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS)
    max_tokens: int = Field(default=131072, ge=1, le=MAX_TOKENS)
    decode_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS)
    max_seconds: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="the app stops itself after this long"
    )

    @model_validator(mode="after")
    def _starts_below_its_end(self) -> SoakSchedule:
        if self.start_tokens is not None and self.start_tokens > self.max_tokens:
            raise ValueError(f"start_tokens {self.start_tokens} is past max_tokens {self.max_tokens}")
        return self


class PlanOptions(StrictModel):
    """Options for the planner's prediction (see `kvrig plan`)."""

    weights: str | None = Field(
        default=None,
        description="the weight recipe to plan (recipes.py); default: the bundle's own (its manifest.json), else "
        "auto as kvrig plan counts it",
    )
    margin: float = Field(
        default=0.0, ge=0, lt=1, allow_inf_nan=False, description="0: predict the context at the limit itself"
    )
    limit: LimitChoice = Field(
        default="app",
        description="the limit to predict against; app: the one iOS gives the run's app: the device's entitled limit "
        "when the app declares com.apple.developer.kernel.increased-memory-limit (read from the entry's .ipa, else "
        "as the phone lists the installed app) and the profile knows one, else the default limit (a phone's "
        "limit_bytes in this file is every app's); default or entitled: that one",
    )
    prefill_step: int = Field(default=512, ge=1)


class Gates(StrictModel):
    min_max_safe_context: int | None = Field(default=None, ge=0, description="tokens")
    # A NaN threshold passes every run (no comparison with it is false), a context below 1 is none measured.
    min_decode_tps_at: dict[Annotated[int, Field(ge=1)], Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict, description="context tokens -> minimum decode tok/s measured there"
    )
    max_predicted_error: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="|measured - predicted| / predicted max context, as a fraction",
    )

    def merged(self, override: Gates | None) -> Gates:
        if override is None:
            return self
        return self.model_copy(update=override.model_dump(exclude_unset=True))


class MatrixEntry(StrictModel):
    app_id: str = Field(min_length=1, description="bundle id of the app on the phone")
    name: str | None = Field(
        default=None, min_length=1, description="names the entry in results (default: bundle or app_id)"
    )
    ipa: Path | None = Field(default=None, description="installed on each device before the runs")
    bundle: str | None = Field(default=None, description="name of the model bundle the app runs (recorded)")
    bundle_path: Path | None = Field(default=None, description="a bundle folder pushed into Documents first")
    model: Path | None = Field(
        default=None, description="config.json, GGUF or model folder for the prediction (default: bundle_path)"
    )
    plan: PlanOptions = Field(default_factory=PlanOptions)
    schemes: list[SchemeSpec] = Field(min_length=1)
    backend: Literal["mlx", "coreml"] = Field(
        default="mlx", description="runtime soaked: MLX, or the Core ML program of an app built with --coreml"
    )
    residencies: list[WeightsResidency] | None = Field(
        default=None,
        min_length=1,
        description="run each scheme with the weights loaded and/or mapped from the bundle's file (the soak plan's "
        "weights_residency; a bundle packaged with --weights-layout mapped can do both); default: one run, as the "
        "bundle says",
    )
    soak: SoakSchedule = Field(default_factory=SoakSchedule)
    on_critical: OnCritical | None = Field(
        default=None,
        description="what the app does at critical memory pressure in this entry's runs (the soak plan's on_critical, "
        "as `kvrig soak --on-critical`): stop_and_save as its bundle's policy says, or continue into the kernel's "
        "limit; default: the lab's",
    )
    gates: Gates | None = Field(default=None, description="override the lab's gates for this entry")

    @field_validator("schemes", mode="before")
    @classmethod
    def _names_to_specs(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="after")
    def _unique_schemes(self) -> MatrixEntry:
        names = [s.name for s in self.schemes]
        if len({folder_key(n) for n in names}) != len(names):
            raise ValueError(f"scheme names repeat (as folder names, where case and punctuation do not count): {names}")
        if self.residencies is not None and len(set(self.residencies)) != len(self.residencies):
            raise ValueError(f"residencies repeat: {self.residencies}")
        if self.residencies is not None and self.backend == "coreml":
            raise ValueError("residencies are the MLX app's: the Core ML program holds its own weights")
        return self

    @property
    def runs_residencies(self) -> list[WeightsResidency | None]:
        """One run per residency listed, else one as the bundle says (None)."""
        return list(self.residencies) if self.residencies else [None]

    @property
    def label(self) -> str:
        return self.name or self.bundle or (self.bundle_path.name if self.bundle_path else self.app_id)

    @property
    def bundle_name(self) -> str | None:
        return self.bundle or (self.bundle_path.name if self.bundle_path else None)

    @property
    def model_source(self) -> Path | None:
        return self.model or self.bundle_path


class ThresholdSearch(StrictModel):
    """After a jetsam, re-run up to the last context that survived until it survives `confirm_runs` times."""

    confirm_runs: int = Field(default=1, ge=0, description="0: no confirmation")
    max_attempts: int = Field(default=3, ge=1, description="confirmation runs at most, per device × entry × scheme")


class Timeouts(StrictModel):
    model_config = ConfigDict(allow_inf_nan=False)  # a NaN or infinite deadline never fires

    run_s: float | None = Field(default=None, gt=0, description="one soak run (default: no limit)")
    hang_after_s: float = Field(default=120.0, gt=0, description="no telemetry this long while alive: hung")
    reconnect_s: float = Field(default=30.0, ge=0, description="how long a vanished phone may take to return")
    report_wait_s: float = Field(default=10.0, ge=0, description="how long the kernel may take to file a report")
    poll_interval_s: float = Field(default=0.5, gt=0, description="how often the app is looked at")


class Lab(StrictModel):
    schema_version: Literal[1] = Field(alias="schema")
    name: str = Field(default="lab", min_length=1)
    devices: list[LabDevice] = Field(default_factory=lambda: [LabDevice(udid=ANY_DEVICE)], min_length=1)
    matrix: list[MatrixEntry] = Field(min_length=1)
    gates: Gates = Field(default_factory=Gates)
    threshold: ThresholdSearch = Field(default_factory=ThresholdSearch)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    on_critical: OnCritical = Field(
        default="stop_and_save",
        description="what the app does at critical memory pressure in every entry's runs that do not set their own: "
        "stop_and_save as its bundle's policy says, or continue into the kernel's limit (a jetsam to measure)",
    )

    @model_validator(mode="after")
    def _unique(self) -> Lab:
        labels = [e.label for e in self.matrix]
        if len({folder_key(label) for label in labels}) != len(labels):
            raise ValueError(
                f"matrix entries need distinct names (set `name`; as folder names, case and punctuation do not "
                f"count): {labels}"
            )
        udids = [d.udid for d in self.devices if d.udid != ANY_DEVICE]
        if len(set(udids)) != len(udids):
            raise ValueError(f"a UDID is listed twice: {udids}")
        return self

    def on_critical_for(self, entry: MatrixEntry) -> OnCritical:
        """The entry's own choice, else the lab's."""
        return entry.on_critical or self.on_critical

    def resolve_paths(self, base: Path) -> Lab:
        """Paths in the file are relative to the file's folder."""
        entries = []
        for e in self.matrix:
            update = {
                key: (base / value if not value.is_absolute() else value)
                for key in ("ipa", "bundle_path", "model")
                if (value := getattr(e, key)) is not None
            }
            entries.append(e.model_copy(update=update))
        return self.model_copy(update={"matrix": entries})


class LabRecord(StrictModel):
    """What a lab's results.json says about the lab, so `kvrig lab merge` can check its shards and evaluate
    the gates again on the merged set."""

    name: str
    shard: str | None = Field(
        default=None, pattern=r"^[1-9][0-9]*/[1-9][0-9]*$", description="K/N when the folder holds one shard of the lab"
    )
    hosts: list[str] = Field(default_factory=list, description="the usbmuxd hosts the phones were found on")
    gates: dict[str, Gates] = Field(default_factory=dict, description="matrix entry -> the gates its runs meet")
    notes: list[str] = Field(default_factory=list)
    outcomes: dict[str, int] = Field(
        default_factory=dict,
        description="runs per kind of end (jetsam, jetsam_log, gpu_background, watchdog, crash, vanished, ...), "
        "confirmation runs included (results schema 4)",
    )

    @field_validator("shard")
    @classmethod
    def _one_of_its_shards(cls, shard: str | None) -> str | None:
        if shard is not None and int(shard.split("/")[0]) > int(shard.split("/")[1]):
            raise ValueError(f"shard {shard}: K/N with K from 1 to N")
        return shard


def count_outcomes(outcomes: Iterable[str | None]) -> dict[str, int]:
    """How many runs ended each way, every kind apart (a run with no outcome as `none`)."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome or "none"] = counts.get(outcome or "none", 0) + 1
    return dict(sorted(counts.items()))


_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


def slug(text: str) -> str:
    """A file-name-safe form of a name from the lab file or a device (never a path, never hidden)."""
    cleaned = _SLUG.sub("-", text).strip(".-") or "x"
    return cleaned[:80]


def folder_key(name: str) -> str:
    """What two names must not share to get folders of their own: their `slug`, without case (macOS's file systems
    ignore it)."""
    return slug(name).casefold()


def load_lab(path: str | Path) -> Lab:
    """Reads and validates a lab file, naming the file and field at fault."""
    path = Path(path)
    data = read_data(path, error=SchemaError, kind="yaml", mapping="a YAML mapping with `schema: 1` and `matrix`")
    lab = validate_data(Lab, data, file=path)
    return lab.resolve_paths(path.resolve().parent)
