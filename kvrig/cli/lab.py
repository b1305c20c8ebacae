"""`kvrig lab run|report`: the device lab as CI (results.json, junit.xml, report.html) and its report."""

from __future__ import annotations

from pathlib import Path

import click

from kvrig.cli.device import parse_tunnel, tunnel_option
from kvrig.cli.options import InputPath
from kvrig.cli.output import OUTPUT, console, info
from kvrig.cli.render import echo_json, json_option, usbmuxd_option


@click.group(
    short_help="Run a matrix of apps, bundles and KV schemes on many phones as CI: results, JUnit, report, gates.",
)
def lab() -> None:
    """Run a matrix of apps, bundles and KV schemes on many phones; gate on max safe context and tok/s."""


def _out_option(help: str):  # type: ignore[no-untyped-def]
    return click.option("-o", "--out", "--output", "out_dir", type=click.Path(path_type=Path), required=True, help=help)


@lab.command("run")
@click.argument("lab_file", type=InputPath(dir_okay=False, path_type=Path))
@_out_option("Output folder (results.json, junit.xml, report.html, runs/).")
@click.option(
    "--shard",
    default=None,
    metavar="K/N",
    help="Run shard K of N: the phones whose UDID hashes to K (rendezvous hashing; adding a phone moves no other).",
)
@click.option(
    "--devices",
    "devices",
    multiple=True,
    metavar="UDID[,UDID...]",
    help="Only these phones (this runner's); one not attached is reported missing.",
)
@usbmuxd_option
@tunnel_option
@click.option(
    "--limits",
    "limits_file",
    type=InputPath(exists=True, dir_okay=False, path_type=Path),
    help="Limits registry (`kvrig calibrate --limits`): predict each phone against the limit its ProductType, OS "
    "build and entitlement stated, where the registry holds one (else the profile's).",
)
@json_option
def run(
    lab_file: Path,
    out_dir: Path,
    shard: str | None,
    devices: tuple[str, ...],
    usbmuxd: tuple[str, ...],
    tunnel: str,
    limits_file: Path | None,
    as_json: bool,
) -> None:
    """Run LAB_FILE on the attached phones (or this runner's share of them).

    Exit codes: 0 every run passed its gates; 17 a gate failed or a run ended badly (crash, hang, device
    lost, could not run); 18 the lab could not run at all (no device matched, no run could start);
    3 the lab file is wrong; 42 --shard is wrong or --usbmuxd names a host twice or without a name; 51 an
    --usbmuxd address is neither a socket path nor HOST:PORT; 34 the output folder holds a lab's results already
    (never overwritten); 38 results could not be written (disk full); 130 Ctrl-C and 143 SIGTERM (each phone's
    app stopped first). A phone whose preflight fails (Developer Mode off, no image, no tunnel)
    fails its runs with that cause."""
    from kvrig.device.apps import INSTALL_BARS
    from kvrig.device.hosts import parse_hosts
    from kvrig.device.loop import run_async
    from kvrig.lab.check import check_lab
    from kvrig.lab.model import raise_for
    from kvrig.lab.schedule import run_lab
    from kvrig.lab.targets import Shard
    from kvrig.schemas.lab import load_lab

    spec = load_lab(lab_file)
    check_lab(spec, lab_file)
    hosts = parse_hosts(usbmuxd)
    share = Shard.parse(shard) if shard else None
    udids = [u for text in devices for u in text.replace(",", " ").split()] or None
    mode = str(parse_tunnel(tunnel))
    echo = None if as_json else info
    INSTALL_BARS.set(not as_json and OUTPUT.verbosity >= 0)  # pymobiledevice3's bars go where progress lines go
    results = run_async(
        run_lab(spec, out_dir, on_event=echo, hosts=hosts, shard=share, devices=udids, tunnel=mode, limits=limits_file)
    )
    if as_json:
        echo_json(results.results)
    else:
        _render(results.results, title=f"lab {results.lab.name}", out_dir=out_dir)
    raise_for(results.results, out_dir, empty_shard_ok=share is not None)


@lab.command("merge")
@click.argument("folders", nargs=-1, required=True, type=InputPath(exists=True, file_okay=False, path_type=Path))
@_out_option("Output folder for the merged results.json, junit.xml, report.html and shards/.")
@json_option
def merge(folders: tuple[Path, ...], out_dir: Path, as_json: bool) -> None:
    """Merge the output folders of a lab's shards into one results.json, junit.xml and report.html.

    Gates are evaluated again on the merged runs. Exit codes as `lab run` (0, 17, 18), and: 42 a folder is not
    a lab's output; 43 shards conflict (the same phone × entry × scheme with different results, or different
    labs or gates); 44 a shard of the lab is missing. The merged files are written in every case."""
    from kvrig.exceptions import MergeConflictError, MissingShardError
    from kvrig.lab.merge import merge_folders
    from kvrig.lab.model import raise_for

    merged = merge_folders(list(folders), out_dir)
    if as_json:
        echo_json({"results": merged.results, "problems": merged.problems()})
    else:
        name = merged.results.lab.name if merged.results.lab else "lab"
        _render(merged.results, title=f"lab {name} (merged from {len(folders)} folders)", out_dir=out_dir)
        for line in merged.problems():
            click.echo(f"merge: {line}", err=True)
    if merged.conflicts:
        raise MergeConflictError(f"{len(merged.conflicts)} conflicts between shards: " + "; ".join(merged.conflicts))
    if merged.missing_shards:
        raise MissingShardError(f"shards missing from the merge: {', '.join(merged.missing_shards)}")
    raise_for(merged.results, out_dir)


@lab.command("report")
@click.argument("results_file", type=InputPath(dir_okay=False, path_type=Path))
@_out_option("Output folder.")
@click.option("--title", default="kvrig results", show_default=True)
@json_option
def report(results_file: Path, out_dir: Path, title: str, as_json: bool) -> None:
    """Render report.html (and its PNGs) from a results.json again."""
    from kvrig.lab.report import write_report
    from kvrig.schemas import load_model_file
    from kvrig.schemas.results import ResultsFile

    results = load_model_file(ResultsFile, results_file)
    page = write_report(results, out_dir, title=title)  # it makes out_dir; a failed write is exit 38
    if as_json:
        from kvrig.lab.report import IMAGES_DIR

        images = sorted(str(p.relative_to(page.parent)) for p in (page.parent / IMAGES_DIR).glob("*") if p.is_file())
        echo_json({"report": str(page), "files": [page.name, *images]})
        return
    click.echo(str(page))


def _render(results, *, title: str, out_dir: Path) -> None:  # type: ignore[no-untyped-def]
    from rich.table import Table

    from kvrig.lab.gates import failures
    from kvrig.schemas.results import short_udid

    table = Table(title=title)
    for col in ("host", "device", "entry", "scheme", "outcome", "max ctx", "safe ctx", "predicted", "result"):
        table.add_column(col, overflow="fold")
    for r in results.runs:
        found = failures(r)
        verdict = "[red]FAIL[/]: " + "; ".join(m for _, m in found) if found else "[green]pass[/]"
        if r.outcome is None:
            verdict = f"[red]ERROR[/]: {r.error}"
        safe = (
            "" if r.max_safe_context is None else f"{r.max_safe_context}{' ✓' if r.max_safe_context_confirmed else ''}"
        )
        predicted = str(r.predicted.max_context) if r.predicted and r.predicted.max_context is not None else ""
        table.add_row(
            r.device.host or "",
            short_udid(r.device.udid),
            str(r.entry),
            r.variant,
            str(r.outcome or ""),
            str(r.max_context_reached or ""),
            safe,
            predicted,
            verdict,
        )
    out = console()
    out.print(table)
    if results.lab is not None and results.lab.outcomes:
        out.print("ends: " + ", ".join(f"{kind} {n}" for kind, n in results.lab.outcomes.items()))
    for note in results.lab.notes if results.lab else []:
        out.print(f"note: {note}")
    out.print(f"results: {out_dir / 'results.json'}, junit: {out_dir / 'junit.xml'}, "
                  f"report: {out_dir / 'report.html'}")  # fmt: skip
