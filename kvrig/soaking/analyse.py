"""From pulled files to results: the run's telemetry, the JetsamEvent report that ended it, the outcome.

Nothing here talks to a device; the driver pulls the files and calls these.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvrig.exceptions import ReportError
from kvrig.reports.jetsam import JetsamReport, read_report, verdict
from kvrig.reports.telemetry import TelemetryRun, correlate, read_telemetry, summarize_run
from kvrig.schemas.results import Outcome, SoakResult, TpsPoint

# End-record reasons that mean the app failed (telemetry EndEvent.reason -> outcome). The others (completed,
# stop_condition, memory_critical) are ends the app chose as planned.
APP_FAILURES: dict[str | None, Outcome] = {"error": "error", "allocation_failed": "allocation_failed"}


def telemetry_run(path: Path, run_id: str) -> TelemetryRun | None:
    """The run with this id in a pulled telemetry file; None if the file has no usable record of it."""
    if not path.exists():
        return None
    try:
        log = read_telemetry(path)
    except ReportError:
        return None
    return next((r for r in log.runs if r.run_id == run_id), None)


def apply_telemetry(result: SoakResult, run: TelemetryRun) -> None:
    summary = summarize_run(run)
    steps = run.steps
    result.max_context_reached = summary.max_context_tokens
    # A step record is written only after the app survived the measurement that preceded it.
    result.max_safe_context = summary.max_context_tokens
    result.last_footprint_bytes = summary.last_footprint_bytes
    result.app_limit_bytes = summary.limit_bytes
    if run.start is not None:
        result.backend = run.start.backend  # what ran, in the app's own words
        if run.start.weights_residency is not None:  # an app that predates it says nothing
            result.weights_residency = run.start.weights_residency
            result.mapped_weight_bytes = run.start.mapped_weight_bytes
            result.residency_note = run.start.residency_note
    result.tps_curve = [
        TpsPoint(
            context_tokens=s.context_tokens,
            decode_tps=s.decode_tps,
            prefill_tps=s.prefill_tps,
            phys_footprint_bytes=s.phys_footprint_bytes,
        )
        for s in steps
    ]


@dataclass
class JetsamMatch:
    path: Path
    report: JetsamReport


def find_kill(report_paths: list[Path], process: str, pid: int | None) -> JetsamMatch | None:
    """The pulled JetsamEvent report in which our process (this pid, when known) was killed."""
    for path in report_paths:
        try:
            report = read_report(path)
        except ReportError:
            continue
        killed = [p for p in report.process_named(process) if p.killed]
        if any(pid is None or p.pid is None or p.pid == pid for p in killed):
            return JetsamMatch(path, report)
    return None


def apply_jetsam(result: SoakResult, match: JetsamMatch, process: str, run: TelemetryRun | None) -> str:
    """Footprint at the kill and the limit from the report; returns a one-line summary."""
    v = verdict(match.report, process)
    result.footprint_at_kill_bytes = v.footprint_bytes
    result.limit_bytes = v.implied_limit_bytes
    if run is not None:
        return correlate(run, match.report, process=process, file=str(match.path)).summary
    return v.summary


def classify(
    *,
    end_seen: bool,
    end_reason: str | None,
    end_message: str | None = None,
    hung: bool,
    timed_out: bool,
    lost: bool,
    killed_by_jetsam: bool,
    crash_reports: list[Path],
) -> tuple[Outcome, str]:
    """The outcome of a run from what the driver saw, most specific evidence first."""
    if lost:
        return "device_lost", "the device went away and did not come back in time"
    if end_seen:
        if end_reason in APP_FAILURES:
            why = f": {end_message}" if end_message else ""
            return APP_FAILURES[end_reason], f"the app ended itself with {end_reason}{why}"
        return "completed", f"the app wrote its end record ({end_reason})"
    if killed_by_jetsam:
        return "jetsam", "killed by jetsam"
    if hung:
        return "hang", "the app stopped writing telemetry while alive; killed"
    if timed_out:
        return "hang", "the run exceeded its time limit; killed"
    if crash_reports:
        return "crash", f"the app died; crash report {crash_reports[0].name}"
    return "crash", "the app died without an end record, a jetsam report or a crash report"
