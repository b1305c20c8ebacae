"""What a lab run is made of: one run per phone × entry × scheme, and the lab's results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import toolchain
from toolchain import gates as gate_checks
from toolchain.schemas.lab import Lab, LabRecord, MatrixEntry, SchemeSpec
from toolchain.schemas.results import ResultsFile, SoakResult

JUNIT_FILE = "junit.xml"
RUNS_DIR = "runs"

Event = Callable[[str], None]


def fails(result: SoakResult) -> bool:
    """A run CI fails on: a bad outcome, a failed gate, or a run that could not be made."""
    return bool(gate_checks.failures(result)) or result.outcome is None


@dataclass
class LabRun:
    """One device × entry × scheme: its final result (the main run, narrowed by the threshold search)."""

    entry: MatrixEntry
    scheme: SchemeSpec
    folder: str  # relative to the output folder
    result: SoakResult


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
        return ResultsFile(tool_version=toolchain.__version__, runs=[r.result for r in self.runs], lab=self.record)

    @property
    def failed(self) -> list[LabRun]:
        return [r for r in self.runs if fails(r.result)]

    @property
    def ran(self) -> list[LabRun]:
        return [r for r in self.runs if r.result.outcome is not None]

    @property
    def passed(self) -> bool:
        return bool(self.runs) and not self.failed
