"""`kvrig lab run|report`: the device lab as CI (results.json, junit.xml, report.html) and its report."""

from __future__ import annotations

from pathlib import Path

import click

from toolchain.cli.render import echo_json, json_option


@click.group(
    short_help="Run a matrix of apps, bundles and KV schemes on many phones as CI: results, JUnit, report, gates.",
)
def lab() -> None:
    """Run a matrix of apps, bundles and KV schemes on many phones; gate on max safe context and tok/s."""


@lab.command("run")
@click.argument("lab_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Output folder (results.json, junit.xml, report.html, runs/).",
)
@json_option
def run(lab_file: Path, out_dir: Path, as_json: bool) -> None:
    """Run LAB_FILE on the attached phones.

    Exit codes: 0 every run passed its gates; 17 a gate failed or a run ended badly (crash, hang, device
    lost, could not run); 18 the lab could not run at all (no device matched, no run could start);
    3 the lab file is wrong."""
    from toolchain.cli.bridge import run_async
    from toolchain.exceptions import GateFailedError, LabError
    from toolchain.lab import run_lab
    from toolchain.schemas.lab import load_lab

    spec = load_lab(lab_file)
    echo = None if as_json else (lambda line: click.echo(line, err=True))
    results = run_async(run_lab(spec, out_dir, on_event=echo))
    if as_json:
        echo_json(results.results)
    else:
        _render(results)
    if not results.ran:
        raise LabError(f"no run could be made; see {out_dir / 'results.json'}")
    if results.failed:
        names = ", ".join(f"{r.result.device.udid[:8]}/{r.result.entry}[{r.result.scheme}]" for r in results.failed)
        raise GateFailedError(f"{len(results.failed)} of {len(results.runs)} runs failed: {names}")


@lab.command("report")
@click.argument("results_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output folder."
)
@click.option("--title", default="kvrig results", show_default=True)
def report(results_file: Path, out_dir: Path, title: str) -> None:
    """Render report.html (and its PNGs) from a results.json again."""
    from toolchain.report import write_report
    from toolchain.schemas import load_model_file
    from toolchain.schemas.results import ResultsFile

    results = load_model_file(ResultsFile, results_file)
    out_dir.mkdir(parents=True, exist_ok=True)
    click.echo(str(write_report(results, out_dir, title=title)))


def _render(results) -> None:  # type: ignore[no-untyped-def]
    from rich.console import Console
    from rich.table import Table

    from toolchain.gates import failures

    table = Table(title=f"lab {results.lab.name}")
    for col in ("device", "entry", "scheme", "outcome", "max ctx", "safe ctx", "predicted", "result"):
        table.add_column(col, overflow="fold")
    for run in results.runs:
        r = run.result
        found = failures(r)
        verdict = "[red]FAIL[/]: " + "; ".join(m for _, m in found) if found else "[green]pass[/]"
        if r.outcome is None:
            verdict = f"[red]ERROR[/]: {r.error}"
        safe = (
            "" if r.max_safe_context is None else f"{r.max_safe_context}{' ✓' if r.max_safe_context_confirmed else ''}"
        )
        predicted = str(r.predicted.max_context) if r.predicted and r.predicted.max_context is not None else ""
        table.add_row(
            r.device.udid[:8],
            str(r.entry),
            r.scheme,
            str(r.outcome or ""),
            str(r.max_context_reached or ""),
            safe,
            predicted,
            verdict,
        )
    console = Console()
    console.print(table)
    for note in results.notes:
        console.print(f"note: {note}")
    console.print(f"results: {results.out_dir / 'results.json'}, junit: {results.out_dir / 'junit.xml'}, "
                  f"report: {results.out_dir / 'report.html'}")  # fmt: skip
