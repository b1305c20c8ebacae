"""From pulled files to results: the run's telemetry, the JetsamEvent report that ended it, the outcome.

Nothing here talks to a device; the driver pulls the files and calls these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvrig.exceptions import (
    AppCrashError,
    AppVanishedError,
    GpuBackgroundError,
    JetsamWithoutReportError,
    ReportError,
    SoakFailedError,
    TunnelLostError,
    WatchdogKillError,
)
from kvrig.reports.devicelog import GPU_BACKGROUND, AppLog
from kvrig.reports.jetsam import JetsamReport, read_report, verdict
from kvrig.reports.telemetry import TelemetryRun, correlate, read_telemetry, summarize_run
from kvrig.schemas.results import BAD_OUTCOMES, DeviceRef, Evidence, Outcome, SoakResult, StatedLimit, TpsPoint
from kvrig.soaking.plan import UNNAMED_SCHEME

# End-record reasons that mean the app failed (telemetry EndEvent.reason -> outcome). The others (completed,
# stop_condition, memory_critical) are ends the app chose as planned.
APP_FAILURES: dict[str | None, Outcome] = {"error": "error", "allocation_failed": "allocation_failed"}
# Each kind of end that is not what a soak is for, and the error (exit code) `kvrig soak` ends with for it;
# the other bad outcomes (hang, device lost, the app's own error end) end with SoakFailedError (16).
END_ERRORS: dict[str, type[SoakFailedError]] = {
    "jetsam_log": JetsamWithoutReportError,
    "gpu_background": GpuBackgroundError,
    "watchdog": WatchdogKillError,
    "crash": AppCrashError,
    "vanished": AppVanishedError,
}


def raise_for(result: SoakResult, results_file: Path) -> None:
    """The error (exit code) a soak that ended as `result` ends with, if any: a lost tunnel, each kind of end that
    is not what a soak is for, and the other bad outcomes; jetsam and a completed run are what a soak is for."""
    where = f"(results: {results_file})"
    if result.outcome == "device_lost" and result.lost == "tunnel":
        raise TunnelLostError(f"soak {result.run_id}: {result.outcome_detail} {where}")
    if result.outcome in END_ERRORS or result.outcome in BAD_OUTCOMES:
        error = END_ERRORS.get(result.outcome or "", SoakFailedError)
        raise error(f"soak {result.run_id} ended in {result.outcome}: {result.outcome_detail} {where}")


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
        if result.scheme == UNNAMED_SCHEME:  # no --scheme: the one the bundle's kvcache.json made the app run
            result.scheme = run.start.scheme
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


# A watchdog kill's report: "Termination Reason: Namespace SPRINGBOARD, Code 0x8badf00d" (text), or the .ips
# body's termination code 2343432205 (the same number in decimal).
_WATCHDOG_REPORT = re.compile(r"0x8badf00d|\"code\"\s*:\s*2343432205", re.IGNORECASE)
REPORT_SCAN_BYTES = 4 * 1024 * 1024  # a crash report is tens of KiB; only this much of one is looked at


def report_says(path: Path) -> tuple[bool, bool]:
    """(a GPU-from-background abort, a watchdog kill) as a pulled crash report says."""
    try:
        with path.open("rb") as f:
            text = f.read(REPORT_SCAN_BYTES).decode(errors="replace")
    except OSError:
        return False, False
    return GPU_BACKGROUND in text, _WATCHDOG_REPORT.search(text) is not None


def stated_limit(log: AppLog, device: DeviceRef, entitled: bool | None) -> StatedLimit | None:
    """The limit the log stated for the app, keyed by the phone's ProductType, build and the entitlement."""
    if log.active_mb is None and log.exceeded_mb is None:
        return None
    return StatedLimit(
        product_type=device.product_type,
        os_version=device.os_version,
        build_version=device.build_version,
        entitled=entitled,
        active_bytes=log.active_bytes,
        inactive_bytes=log.inactive_bytes,
        exceeded_bytes=log.exceeded_bytes,
        exceeded_kind=log.exceeded_kind,
        lines=[line for line in (log.limit_line, log.end("jetsam")) if line is not None],
    )


def _logged(detail: str, line: str | None) -> list[Evidence]:
    """A device-log line as evidence, when the log had one."""
    return [Evidence(kind="log", detail=detail, line=line)] if line is not None else []


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
    jetsam_report: Path | None = None,
    log: AppLog | None = None,
    base: Path | None = None,
) -> tuple[Outcome, str, list[Evidence]]:
    """The outcome of a run from what the driver saw, most specific evidence first, with that evidence."""

    def rel(path: Path) -> str:
        return path.relative_to(base).as_posix() if base is not None and path.is_relative_to(base) else str(path)

    if lost:
        return "device_lost", "the device went away and did not come back in time", []
    if end_seen:
        told = [Evidence(kind="telemetry", detail=f"end record: {end_reason}")]
        if end_reason in APP_FAILURES:
            why = f": {end_message}" if end_message else ""
            return APP_FAILURES[end_reason], f"the app ended itself with {end_reason}{why}", told
        return "completed", f"the app wrote its end record ({end_reason})", told
    if killed_by_jetsam:
        evidence = [
            Evidence(
                kind="jetsam_report",
                detail="JetsamEvent report names the app killed",
                file=rel(jetsam_report) if jetsam_report else None,
            )
        ]
        evidence += _logged("the kernel's jetsam line", log.end("jetsam") if log is not None else None)
        return "jetsam", "killed by jetsam", evidence
    if hung:
        return "hang", "the app stopped writing telemetry while alive; killed", []
    if timed_out:
        return "hang", "the run exceeded its time limit; killed", []
    said = {path: report_says(path) for path in crash_reports}
    gpu_line = log.end("gpu_background") if log is not None else None
    gpu_reports = [path for path, (gpu, _) in said.items() if gpu]
    if gpu_line is not None or gpu_reports:
        evidence = _logged("GPU work submitted from the background", gpu_line)
        evidence += [Evidence(kind="crash_report", detail="the abort's crash report", file=rel(p)) for p in gpu_reports]
        return "gpu_background", f"aborted: {GPU_BACKGROUND}", evidence
    dog_line = log.end("watchdog") if log is not None else None
    dog_reports = [path for path, (_, dog) in said.items() if dog]
    if dog_line is not None or dog_reports:
        evidence = _logged("the watchdog's termination", dog_line)
        evidence += [Evidence(kind="crash_report", detail="termination 0x8badf00d", file=rel(p)) for p in dog_reports]
        return "watchdog", "killed by the watchdog (0x8badf00d)", evidence
    jetsam_line = log.end("jetsam") if log is not None else None
    if jetsam_line is not None:
        return (
            "jetsam_log",
            "killed by jetsam as the device log says; the phone filed no JetsamEvent report",
            _logged("the kernel's jetsam line", jetsam_line),
        )
    if crash_reports:
        return (
            "crash",
            f"the app died; crash report {crash_reports[0].name}",
            [Evidence(kind="crash_report", detail="the app's crash report", file=rel(p)) for p in crash_reports],
        )
    return (
        "vanished",
        "the app died without an end record, a report or a line in the device log",
        [Evidence(kind="none", detail="no end record, no JetsamEvent or crash report, nothing in the device log")],
    )
