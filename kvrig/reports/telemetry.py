"""Read the app's telemetry (JSON Lines, one event per line), summarise each run, and line a run up with
the JetsamEvent report that ended it.

The app can be killed mid-write, so a last line without its newline that does not parse is expected: it is
kept aside as `torn_line`, not an error. Bad lines elsewhere are skipped and counted; the first
MAX_SKIPPED_LISTED are listed with their line number and why. The file is read line by line, and a line that
cannot be a JSON object is skipped without parsing it, so memory and time follow the records, not the garbage.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from kvrig.exceptions import InputError, ReportError
from kvrig.reports.jetsam import JetsamReport, report_time, verdict
from kvrig.schemas import describe_validation_error
from kvrig.schemas.telemetry import (
    EndEvent,
    EvictEvent,
    MemoryPressureEvent,
    StartEvent,
    StepEvent,
    TelemetryEvent,
)

MAX_TELEMETRY_BYTES = 512 * 1024 * 1024
MAX_SKIPPED_LISTED = 20  # bad lines described one by one; the rest are only counted
_EVENT = TypeAdapter(TelemetryEvent)
_CHECKPOINTS = [2**k for k in range(8, 21)]  # 256 .. 1M tokens: where tok/s is reported
_CURVE_POINTS = 24


class SkippedLine(BaseModel):
    line: int
    reason: str


class TelemetryRun(BaseModel):
    run_id: str
    events: list[Any] = Field(description="events of this run in file order (TelemetryEvent models)")

    @property
    def start(self) -> StartEvent | None:
        return next((e for e in self.events if isinstance(e, StartEvent)), None)

    @property
    def steps(self) -> list[StepEvent]:
        return [e for e in self.events if isinstance(e, StepEvent)]

    @property
    def end(self) -> EndEvent | None:
        return next((e for e in reversed(self.events) if isinstance(e, EndEvent)), None)


class TelemetryLog(BaseModel):
    file: str
    runs: list[TelemetryRun]
    lines: int
    skipped: list[SkippedLine] = Field(
        default_factory=list, description=f"the first {MAX_SKIPPED_LISTED} bad lines, with why"
    )
    skipped_lines: int = Field(0, description="how many lines were skipped in all")
    torn_line: int | None = Field(None, description="number of the torn last line (killed mid-write)")

    @property
    def partial(self) -> bool:
        return bool(self.skipped_lines)


class RunSummary(BaseModel):
    file: str
    run_id: str
    model: str | None = None
    scheme: str | None = None
    product_type: str | None = None
    os_version: str | None = None
    limit_bytes: int | None = None
    converted: list[str] = Field(default_factory=list)
    steps: int
    max_context_tokens: int | None
    max_footprint_bytes: int | None
    last_context_tokens: int | None
    last_footprint_bytes: int | None
    tps_at_context: list[tuple[int, float]] = Field(
        default_factory=list,
        description="(context tokens, decode tok/s) of the step that last reached each power of two, and the last step",
    )
    footprint_curve: list[tuple[int, int]] = Field(
        default_factory=list, description="(context tokens, phys_footprint bytes), at most 24 points"
    )
    memory_pressure: dict[str, int] = Field(default_factory=dict)
    evictions: int = 0
    end_reason: str | None = Field(None, description="None: the run has no end record (killed?)")


class Correlation(BaseModel):
    telemetry_file: str
    report_file: str
    run_id: str
    process: str
    killed: bool
    reason: str | None
    last_context_tokens: int | None
    last_footprint_bytes: int | None = Field(description="last footprint the app wrote before the event")
    report_footprint_bytes: int | None = Field(description="footprint in the JetsamEvent report")
    gap_bytes: int | None = Field(description="report footprint minus last telemetry footprint")
    gap_seconds: float | None = Field(None, description="report time minus last telemetry record time")
    app_limit_bytes: int | None = Field(None, description="limit the app believed in (start record)")
    implied_limit_bytes: int | None = Field(None, description="limit the report implies (per-process-limit)")
    summary: str


# --- reading ------------------------------------------------------------------------------------------


def read_telemetry(path: str | Path) -> TelemetryLog:
    """All runs in a telemetry file. Raises ReportError only when nothing in it is usable."""
    path = Path(path)
    runs: dict[str, list[Any]] = {}
    skipped: list[SkippedLine] = []
    skipped_lines = 0
    torn: int | None = None
    number = 0
    with _open(path) as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            torn_candidate = not raw.endswith(b"\n")  # only the last line can lack its newline
            reason, event, cut = _parse_line(raw)
            if event is not None:
                runs.setdefault(event.run_id, []).append(event)
            elif torn_candidate and cut:
                torn = number
            else:
                skipped_lines += 1
                if len(skipped) < MAX_SKIPPED_LISTED:
                    skipped.append(SkippedLine(line=number, reason=reason))
    if not runs:
        first = skipped[0] if skipped else None
        detail = f"; line {first.line}: {first.reason}" if first else ""
        if skipped_lines > 1:
            detail += f" ({skipped_lines} bad lines in all)"
        if torn is not None and not skipped:
            detail = f"; only a torn line {torn}"
        raise ReportError(f"no telemetry records{detail}", file=path, expected="JSON Lines telemetry events")
    return TelemetryLog(
        file=str(path),
        runs=[TelemetryRun(run_id=rid, events=sorted(ev, key=lambda e: e.seq)) for rid, ev in runs.items()],
        lines=number,
        skipped=skipped,
        skipped_lines=skipped_lines,
        torn_line=torn,
    )


def _parse_line(raw: bytes) -> tuple[str, Any, bool]:
    """(why it was skipped, None, whether it reads as an object cut short) or ("", the event, False) for one
    line. Only a cut object can be a write the app was killed in; other text is not the app's."""
    if not raw.lstrip().startswith(b"{"):  # no JSON object can start otherwise: skipped without parsing
        return "not JSON: not an object", None, False
    try:
        text = raw.decode("utf-8")
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {_short(exc)}", None, not _whole_object_first(text)
    except (UnicodeDecodeError, RecursionError) as exc:
        return f"not JSON: {_short(exc)}", None, False
    try:
        return "", _EVENT.validate_python(obj), False
    except ValidationError as exc:
        field, message, expected = describe_validation_error(exc)
        where = f"field '{field}': " if field else ""
        return f"{where}{message}" + (f" (expected {expected})" if expected else ""), None, False


def _whole_object_first(text: str) -> bool:
    """Whether `text` opens with a whole JSON object (then more): not a write cut short."""
    try:
        json.JSONDecoder().raw_decode(text.lstrip())
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def end_record(raw: bytes, run_id: str) -> EndEvent | None:
    """The end record of run `run_id` if this one line is it (a cheap test first: most lines are steps)."""
    if b'"end"' not in raw:
        return None
    _, event, _ = _parse_line(raw)
    return event if isinstance(event, EndEvent) and event.run_id == run_id else None


@contextlib.contextmanager
def _open(path: Path) -> Iterator[BinaryIO]:
    try:
        if path.is_dir():
            raise ReportError("is a directory, not a telemetry file", file=path)
        size = path.stat().st_size
        if size > MAX_TELEMETRY_BYTES:
            raise ReportError(
                f"file is {size} bytes, too large", file=path, expected=f"at most {MAX_TELEMETRY_BYTES} bytes"
            )
        f = path.open("rb")
    except FileNotFoundError:
        raise ReportError("file not found", file=path) from None
    except OSError as exc:
        raise ReportError(f"cannot read: {exc.strerror or exc}", file=path) from None
    with f:
        yield f


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:80]


# --- summarising ---------------------------------------------------------------------------------------


def summarize(
    log: TelemetryLog, report: JetsamReport | None = None, *, process: str | None = None
) -> list[tuple[RunSummary, Correlation | None]]:
    """Each run of the log summarised and, with a JetsamEvent report, lined up with it (`correlate`) as the app's
    process `process`, else as the results.json beside the telemetry records it (`recorded_process`); InputError
    when neither names it."""
    out = []
    for run in log.runs:
        corr = None
        if report is not None:
            name = process or recorded_process(log.file, run.run_id)
            if name is None:
                raise InputError(
                    f"no results.json beside it records run {run.run_id}'s process, and no --process names it",
                    file=log.file,
                    expected="--process NAME, the app's executable name in the jetsam report",
                )
            corr = correlate(run, report, process=name, file=log.file)
        out.append((summarize_run(run, file=log.file), corr))
    return out


def summarize_run(run: TelemetryRun, *, file: str = "") -> RunSummary:
    start, steps, end = run.start, run.steps, run.end
    contexts = [s.context_tokens for s in steps]
    pressure: dict[str, int] = {}
    for e in run.events:
        if isinstance(e, MemoryPressureEvent):
            pressure[e.level] = pressure.get(e.level, 0) + 1
    return RunSummary(
        file=file,
        run_id=run.run_id,
        model=start.model if start else None,
        scheme=start.scheme if start else None,
        product_type=start.product_type if start else None,
        os_version=start.os_version if start else None,
        limit_bytes=start.limit_bytes if start else None,
        converted=start.converted if start else [],
        steps=len(steps),
        max_context_tokens=max(contexts) if contexts else None,
        max_footprint_bytes=max((s.phys_footprint_bytes for s in steps), default=None),
        last_context_tokens=steps[-1].context_tokens if steps else None,
        last_footprint_bytes=steps[-1].phys_footprint_bytes if steps else None,
        tps_at_context=_tps_at_checkpoints(steps),
        footprint_curve=_downsample([(s.context_tokens, s.phys_footprint_bytes) for s in steps]),
        memory_pressure=pressure,
        evictions=sum(1 for e in run.events if isinstance(e, EvictEvent)),
        end_reason=end.reason if end else None,
    )


def _tps_at_checkpoints(steps: list[StepEvent]) -> list[tuple[int, float]]:
    """For each power of two, the last step at or below it, labelled with the context that step measured (a
    260-token step is not "tok/s at 512"), and the last step."""
    timed = [(s.context_tokens, s.decode_tps) for s in steps if s.decode_tps is not None]
    if not timed:
        return []
    top = max(c for c, _ in timed)
    chosen: dict[int, float] = {}
    for point in _CHECKPOINTS:
        below = [(c, tps) for c, tps in timed if c <= point]
        if below:
            chosen.setdefault(*below[-1])
        if point >= top:
            break
    chosen.setdefault(*timed[-1])
    return sorted(chosen.items())


def _downsample(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    if len(points) <= _CURVE_POINTS:
        return points
    stride = (len(points) - 1) / (_CURVE_POINTS - 1)
    return [points[round(i * stride)] for i in range(_CURVE_POINTS)]


# --- correlating with a jetsam report -------------------------------------------------------------------


def recorded_process(telemetry_file: str | Path, run_id: str) -> str | None:
    """The app's process name a soak or lab recorded for `run_id` in the results.json it wrote beside this
    telemetry (the file's folder or one of the three above it: soak and lab layouts); None if none says."""
    from kvrig.schemas import load_model_file
    from kvrig.schemas.results import RESULTS_FILE, ResultsFile

    here = Path(telemetry_file).resolve().parent
    for folder in (here, *list(here.parents)[:3]):
        path = folder / RESULTS_FILE
        if not path.is_file():
            continue
        try:
            results = load_model_file(ResultsFile, path)
        except (InputError, OSError):  # someone else's results.json: it cannot say
            continue
        for result in results.runs:
            if result.run_id == run_id and result.process:
                return result.process
    return None


def correlate(run: TelemetryRun, report: JetsamReport, *, process: str, file: str = "") -> Correlation:
    """Lines a run up with a JetsamEvent report: last context and footprint before the event, and how far
    the app's last self-measured footprint was from what the kernel recorded."""
    v = verdict(report, process)
    steps = run.steps
    last = steps[-1] if steps else None
    last_fp = last.phys_footprint_bytes if last else None
    gap = v.footprint_bytes - last_fp if v.footprint_bytes is not None and last_fp is not None else None
    when = report_time(report)
    gap_s = None
    if when is not None and run.events:
        last_t = max(e.t for e in run.events)
        gap_s = when.timestamp() - last_t
    start = run.start
    if not v.present:
        summary = f"{process} is not in {Path(report.file).name}: this report is not about run {run.run_id}"
    elif last is None:
        summary = f"run {run.run_id} has no step records to compare with the report"
    else:
        state = f"killed ({v.reason})" if v.killed else "not killed"
        summary = (
            f"{process} {state}; last telemetry: {last.context_tokens} tokens at {last_fp} bytes; "
            f"report: {v.footprint_bytes} bytes (gap {gap:+d} bytes)"
            if gap is not None
            else f"{process} {state}; last telemetry at {last.context_tokens} tokens"
        )
    return Correlation(
        telemetry_file=file,
        report_file=report.file,
        run_id=run.run_id,
        process=process,
        killed=v.killed,
        reason=v.reason,
        last_context_tokens=last.context_tokens if last else None,
        last_footprint_bytes=last_fp,
        report_footprint_bytes=v.footprint_bytes,
        gap_bytes=gap,
        gap_seconds=gap_s,
        app_limit_bytes=start.limit_bytes if start else None,
        implied_limit_bytes=v.implied_limit_bytes,
        summary=summary,
    )
