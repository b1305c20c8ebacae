"""What a lab run is made of: one run per phone × entry × scheme (× weights residency, when the entry lists
them), and the lab's results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvrig.device.discovery import DeviceInfo
from kvrig.exceptions import GateFailedError, LabError
from kvrig.lab import gates as gate_checks
from kvrig.schemas.kvcache import WeightsResidency
from kvrig.schemas.lab import Lab, LabRecord, MatrixEntry, SchemeSpec, slug
from kvrig.schemas.results import DeviceRef, Prediction, ResultsFile, SoakResult, short_udid
from kvrig.schemas.soakplan import OnCritical
from kvrig.version import __version__

JUNIT_FILE = "junit.xml"
RUNS_DIR = "runs"

Event = Callable[[str], None]


def fails(result: SoakResult) -> bool:
    """A run CI fails on: a bad outcome, a failed gate, or a run that could not be made."""
    return bool(gate_checks.failures(result)) or result.outcome is None


def raise_for(results: ResultsFile, out_dir: Path, *, empty_shard_ok: bool = False) -> None:
    """The error `lab run` and `lab merge` end with: LabError (18) when nothing ran, GateFailedError (17) naming
    each run that failed by host, phone, entry and variant. A shard that owns none of the phones has no runs and
    passes."""
    if empty_shard_ok and not results.runs:
        return
    if not any(r.outcome is not None for r in results.runs):
        raise LabError(f"no run could be made; see {out_dir / 'results.json'}")
    failed = [r for r in results.runs if fails(r)]
    if failed:
        names = ", ".join(f"{_where(r)}/{r.entry}[{r.variant}]" for r in failed)
        raise GateFailedError(f"{len(failed)} of {len(results.runs)} runs failed: {names}")


def _where(r: SoakResult) -> str:
    return f"{r.device.host}:{short_udid(r.device.udid)}" if r.device.host else short_udid(r.device.udid)


@dataclass
class LabRun:
    """One device × entry × scheme × residency: its final result (the main run, narrowed by the threshold
    search)."""

    entry: MatrixEntry
    scheme: SchemeSpec
    folder: str  # relative to the output folder
    result: SoakResult
    residency: WeightsResidency | None = None
    """What the soak plan asks of the app (None: as the bundle says)."""

    @property
    def label(self) -> str:
        return f"{self.entry.label} / {self.scheme.name}" + (f" / {self.residency}" if self.residency else "")


def device_ref(udid: str, info: DeviceInfo | None, host: str | None) -> DeviceRef:
    """How results name a phone: what lockdownd said of it (if it was found) and the host it is on."""
    return DeviceRef(
        udid=udid,
        product_type=info.product_type if info else None,
        os_version=info.os_version if info else None,
        build_version=info.build_version if info else None,
        profile=info.profile if info else None,
        host=host,
        virtual=bool(info and info.virtual),
    )


def new_run(
    entry: MatrixEntry,
    scheme: SchemeSpec,
    device: DeviceRef,
    stamp: str,
    predicted: Prediction | None = None,
    residency: WeightsResidency | None = None,
    on_critical: OnCritical | None = None,
) -> LabRun:
    """A run not made yet: its folder under runs/, its id, and a result with no outcome. A residency the entry
    lists gets a folder (and a part of the id) of its own below the scheme's."""
    folder = f"{RUNS_DIR}/{slug(device.udid)}/{slug(entry.label)}/{slug(scheme.name)}"
    parts = [entry.label, scheme.name, short_udid(device.udid), stamp]
    if residency is not None:
        folder += f"/{residency}"
        parts.insert(2, residency)
    result = SoakResult(
        run_id="-".join(slug(p) for p in parts),
        device=device,
        app_id=entry.app_id,
        bundle=entry.bundle_name,
        scheme=scheme.name,
        weights_residency_requested=residency,
        on_critical=on_critical,
        entry=entry.label,
        predicted=predicted,
    )
    return LabRun(entry, scheme, folder, result, residency)


@dataclass
class LabResults:
    lab: Lab
    out_dir: Path
    runs: list[LabRun]
    notes: list[str] = field(default_factory=list)
    shard: str | None = None  # "K/N" when this is one shard of the lab
    hosts: list[str] = field(default_factory=list)

    @property
    def record(self) -> LabRecord:
        gates = {e.label: self.lab.gates.merged(e.gates) for e in self.lab.matrix}
        return LabRecord(name=self.lab.name, shard=self.shard, hosts=self.hosts, gates=gates, notes=self.notes)

    @property
    def results(self) -> ResultsFile:
        return ResultsFile(tool_version=__version__, runs=[r.result for r in self.runs], lab=self.record)

    @property
    def failed(self) -> list[LabRun]:
        return [r for r in self.runs if fails(r.result)]

    @property
    def ran(self) -> list[LabRun]:
        return [r for r in self.runs if r.result.outcome is not None]

    @property
    def passed(self) -> bool:
        return bool(self.runs) and not self.failed
