"""`kvrig telemetry FILE...`: summarise each run in the app's JSONL telemetry; with --report, line the run
up with the JetsamEvent report that ended it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvrig.cli.output import console
from kvrig.cli.render import echo_json, human_bytes, json_option, read_each
from kvrig.exceptions import ReportError

if TYPE_CHECKING:
    from kvrig.reports.telemetry import Correlation, RunSummary, TelemetryLog


@click.command(
    "telemetry",
    short_help="Summarise the app's JSONL telemetry per run; correlate a run with its jetsam report.",
)
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="A JetsamEvent report to correlate.")
@click.option(
    "--process",
    metavar="NAME",
    help="The app's process name in the report; default: what the results.json beside the telemetry records.",
)
@json_option
def telemetry(files: tuple[Path, ...], report_path: Path | None, process: str | None, as_json: bool) -> None:
    """Summarise telemetry runs: max context, tok/s at context points, footprint curve, jetsam correlation."""
    from kvrig.reports.jetsam import read_report
    from kvrig.reports.telemetry import read_telemetry, summarize

    report = read_report(report_path) if report_path is not None else None
    results: list[dict[str, Any]] = []
    errors: list[ReportError] = []
    for _, log in read_each(files, read_telemetry, as_json=as_json, results=results, errors=errors):
        for summary, corr in summarize(log, report, process=process):
            entry = summary.model_dump(mode="json")
            entry["skipped_lines"] = [s.model_dump() for s in log.skipped]
            entry["skipped_count"] = log.skipped_lines
            entry["torn_line"] = log.torn_line
            entry["partial"] = log.partial
            if corr is not None:
                entry["correlation"] = corr.model_dump(mode="json")
            results.append(entry)
            if not as_json:
                _render(summary, log, corr)
    if as_json:
        echo_json(results)
    if errors:
        raise ReportError(f"{len(errors)} of {len(files)} telemetry files could not be read")


def _render(s: RunSummary, log: TelemetryLog, corr: Correlation | None) -> None:
    from rich.table import Table

    out = console(min_width=120)
    out.print(
        f"[bold]{s.file}[/bold] run {s.run_id}: {s.model or '?'} · {s.scheme or '?'} · "
        f"{s.product_type or '?'} · {s.os_version or '?'}"
    )
    out.print(
        f"  {s.steps} steps, max context {s.max_context_tokens}, "
        f"max footprint {human_bytes(s.max_footprint_bytes) if s.max_footprint_bytes else '?'}, "
        f"end: {s.end_reason or 'no end record (killed?)'}"
    )
    if s.tps_at_context:
        table = Table("context", "decode tok/s")
        for ctx, tps in s.tps_at_context:
            table.add_row(str(ctx), f"{tps:.1f}")
        out.print(table)
    if s.footprint_curve:
        out.print("  footprint: " + ", ".join(f"{c}:{human_bytes(b)}" for c, b in s.footprint_curve))
    if log.torn_line:
        out.print(f"  torn last line {log.torn_line} (killed mid-write), ignored")
    for sk in log.skipped:
        out.print(f"  [yellow]skipped line {sk.line}:[/yellow] {sk.reason}")
    if log.skipped_lines > len(log.skipped):
        out.print(f"  [yellow]... and {log.skipped_lines - len(log.skipped)} more bad lines skipped[/yellow]")
    if corr is not None:
        out.print(f"  jetsam: {corr.summary}")
