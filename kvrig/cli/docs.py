"""`kvrig docs`: the docs' measured figures, measured and rendered (kvrig/docgen.py)."""

from __future__ import annotations

from pathlib import Path

import click

from kvrig.cli.options import InputPath
from kvrig.cli.output import info
from kvrig.cli.render import echo_json, json_option

_root = click.option(
    "--root",
    type=InputPath(path_type=Path, exists=True, file_okay=False),
    default=Path("."),
    show_default=True,
    help="The checkout whose docs/ to use.",
)


@click.group("docs", short_help="Measure the benchmarks the docs quote; render the docs' generated sections.")
def docs() -> None:
    """The docs' measured figures: docs/benchmarks.yaml names the benchmarks, docs/data holds what they printed,
    docs/templates the sections of the pages rendered from it."""


@docs.command("measure")
@click.argument("names", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Every benchmark docs/benchmarks.yaml names.")
@_root
@json_option
def measure(names: tuple[str, ...], every: bool, root: Path, as_json: bool) -> None:
    """Run the benchmarks NAMES (as docs/benchmarks.yaml gives them) and write docs/data/NAME.json for each.
    Run `kvrig docs render` afterwards."""
    from kvrig.docgen import benchmark, load_benchmarks, measure

    if every == bool(names):
        raise click.UsageError("give benchmark names or --all")
    for name in names:
        benchmark(root, name)  # every name checked before the first benchmark runs for minutes
    measured = []
    for name in sorted(load_benchmarks(root)) if every else names:
        info(f"measuring {name} ...")
        done = measure(root, name)
        measured.append({"name": name, "data": f"docs/data/{name}.json", "seconds": round(done.seconds, 1)})
        if not as_json:
            click.echo(f"docs/data/{name}.json: {done.seconds:.0f} s")
    if as_json:
        echo_json(measured)


@docs.command("render")
@click.option("--check", is_flag=True, help="Change nothing; exit 54 if a page differs from its render.")
@_root
@json_option
def render(check: bool, root: Path, as_json: bool) -> None:
    """Fill every page's generated sections from docs/templates and docs/data."""
    from kvrig.docgen import DocsStaleError, stale_pages, write_docs

    if check:
        stale = stale_pages(root)
        if stale:
            raise DocsStaleError("; ".join(stale) + " (run `kvrig docs measure` and `kvrig docs render`)")
        if as_json:
            echo_json({"stale": []})
            return
        click.echo("docs: every generated section is as rendered")
        return
    pages = [str(page.relative_to(root)) for page in write_docs(root)]
    if as_json:
        echo_json({"rendered": pages})
        return
    for page in pages:
        click.echo(f"{page}: rendered")
