"""Saving: results.json and junit.xml are rewritten after every run, so a lab that dies half-way leaves what it
learned (runs not started yet have no outcome: junit.xml shows them as errors, not run)."""

from __future__ import annotations

import json
from pathlib import Path

from kvrig.exceptions import KvrigError
from kvrig.fileio import atomic_write
from kvrig.lab import gates as gate_checks
from kvrig.lab.junit import write_junit
from kvrig.lab.model import JUNIT_FILE
from kvrig.schemas import load_model_file
from kvrig.schemas.lab import count_outcomes
from kvrig.schemas.results import RESULTS_FILE, ResultsFile, SoakFiles, SoakResult


def evaluate_gates(results: ResultsFile) -> None:
    """Each run's gates, from the lab record (the entry's gates over the lab's); a run without an outcome
    has none."""
    record = results.lab
    for run in results.runs:
        gates = record.gates.get(run.entry or "") if record is not None else None
        if gates is None or run.outcome is None:
            run.gates = []
        else:
            run.gates = gate_checks.evaluate(run, gates)


def save_results(results: ResultsFile, out: Path, *, problems: list[tuple[str, str]] | None = None) -> None:
    """results.json and junit.xml; `problems`: what a merge found wrong, (kind, message), as junit cases."""
    evaluate_gates(results)
    if results.lab is not None:
        ends = [o for r in results.runs for o in (r.outcome, *(c.outcome for c in r.confirmations))]
        results.lab.outcomes = count_outcomes(ends)
    data = results.model_dump(mode="json", by_alias=True, exclude_none=False)
    atomic_write(out / RESULTS_FILE, json.dumps(data, indent=2) + "\n")
    name = results.lab.name if results.lab else "kvrig lab"
    write_junit(results, out / JUNIT_FILE, name=name, problems=problems)


def read_partial(folder: Path) -> SoakResult | None:
    """What the soak driver saved in its folder before a step failed."""
    try:
        return load_model_file(ResultsFile, folder / RESULTS_FILE).runs[0]
    except (KvrigError, IndexError):
        return None


def relocate(result: SoakResult, folder: str) -> None:
    """Soak file paths are relative to the soak's folder; the lab's results file sits above it."""
    f = result.files
    result.files = SoakFiles(
        telemetry=f"{folder}/{f.telemetry}" if f.telemetry else None,
        jetsam_reports=[f"{folder}/{p}" for p in f.jetsam_reports],
        crash_reports=[f"{folder}/{p}" for p in f.crash_reports],
        skipped_reports=f.skipped_reports,
    )
