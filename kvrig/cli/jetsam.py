"""`kvrig jetsam REPORT...`: what each JetsamEvent report says, and the verdict for our app."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvrig.cli.output import console
from kvrig.cli.render import echo_json, human_bytes, json_option, read_each
from kvrig.exceptions import NotAJetsamReportError, ProcessNotInReportsError, ReportError

if TYPE_CHECKING:
    from kvrig.reports.jetsam import JetsamProcess, JetsamReport, Verdict


@click.command(
    "jetsam",
    short_help="Read JetsamEvent reports: memory, killed processes and why, the verdict for our app.",
)
@click.argument("reports", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--process",
    "process",
    metavar="NAME",
    help="Give the verdict for this process: the app's executable name (reports do not name bundle ids).",
)
@json_option
def jetsam(reports: tuple[Path, ...], process: str | None, as_json: bool) -> None:
    """Read JetsamEvent reports (.ips, .ips.synced): memory, largest process, killed processes and why."""
    from kvrig.reports.jetsam import read_report, verdict

    results: list[dict[str, Any]] = []
    errors: list[ReportError] = []
    present = False
    for _, report in read_each(reports, read_report, as_json=as_json, results=results, errors=errors):
        entry = report.model_dump(mode="json", exclude={"processes"})
        entry["killed"] = [_process_json(p) for p in report.killed]
        v = verdict(report, process) if process else None
        if v is not None:
            entry["verdict"] = v.model_dump(mode="json")
            present = present or v.present
        results.append(entry)
        if not as_json:
            _render(report, v)
    if as_json:
        echo_json(results)
    if errors:
        kind = ReportError if any(type(e) is not NotAJetsamReportError for e in errors) else NotAJetsamReportError
        raise kind(f"{len(errors)} of {len(reports)} files could not be read as JetsamEvent reports")
    if process and not present:
        # A verdict on nothing must not exit as a clean "not killed": a script would read it as one.
        raise ProcessNotInReportsError(
            f"{process} is in none of the {len(reports)} reports: no verdict (each report's is printed)"
        )


def _process_json(p: JetsamProcess) -> dict[str, Any]:
    data = p.model_dump(mode="json")
    data["killed"] = True
    return data


def _band_name(band: str | None, priority: int | None) -> str:
    """'AGING_BAND1 (1)' out of 'AGING_BAND1 (1): aging band 1 ...' so the table stays narrow."""
    if band:
        return band.split(": ")[0]
    return str(priority) if priority is not None else ""


def _render(report: JetsamReport, v: Verdict | None) -> None:
    from rich.table import Table

    out = console(min_width=120)
    device = report.product or "unknown device"
    if report.profile:
        device += f" ({report.profile})"
    page = f"{report.page_size} B pages" if report.page_size else "page size unknown"
    out.print(f"[bold]{report.file}[/bold]")
    out.print(f"  {report.os_version or 'OS unknown'} · {device} · {report.timestamp or 'time unknown'} · {page}")
    mem = report.memory
    parts = [f"{k} {human_bytes(b)}" for k, b in mem.bytes.items() if k in ("free", "active", "inactive", "wired")]
    if mem.compressed_bytes is not None:
        parts.append(f"compressed {human_bytes(mem.compressed_bytes)}")
    if parts:
        out.print("  memory: " + ", ".join(parts))
    largest = report.largest_process or "not recorded"
    if report.largest_process_bytes is not None:
        largest += f" ({human_bytes(report.largest_process_bytes)})"
    out.print(f"  largest process: {largest}")
    if report.killed:
        table = Table("killed", "pid", "reason", "footprint", "peak", "states", "priority band", "implied limit")
        for p in report.killed:
            table.add_row(
                p.name or "?",
                str(p.pid or "?"),
                p.reason or "",
                human_bytes(p.footprint_bytes) if p.footprint_bytes is not None else "?",
                human_bytes(p.lifetime_peak_bytes) if p.lifetime_peak_bytes is not None else "",
                ",".join(p.states),
                _band_name(p.priority_band, p.priority),
                human_bytes(p.implied_limit_bytes) if p.implied_limit_bytes is not None else "",
            )
        out.print(table)
    else:
        out.print("  no process killed in this report")
    if report.partial:
        out.print("  [yellow]partial:[/yellow] " + "; ".join(report.problems))
    if v is not None:
        colour = "red" if v.killed else "green"
        out.print(f"  [{colour}]verdict:[/{colour}] {v.summary}")
