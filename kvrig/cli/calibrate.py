"""`kvrig calibrate`: fit the planner's baseline per device profile to measured soaks."""

from __future__ import annotations

from pathlib import Path

import click

from kvrig.cli.options import InputPath, checked_specs
from kvrig.cli.output import console
from kvrig.cli.render import echo_json, human_bytes, json_option


@click.command(
    "calibrate",
    short_help="Fit the planner's baseline per device profile to measured soaks; write calibration.json.",
)
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--bundle", type=click.Path(path_type=Path), help="Bundle the runs ran (default: the one each names).")
@click.option("--model", type=click.Path(path_type=Path), help="Model for runs without a bundle (dir, config, GGUF).")
@click.option(
    "--weights",
    default="q4",
    show_default=True,
    callback=checked_specs("weights", auto=False, several=False),
    help="Weight recipe with --model.",
)
@click.option(
    "-o",
    "--out",
    "--output",
    "out",
    type=click.Path(path_type=Path),
    default=Path("calibration.json"),
    show_default=True,
)
@click.option(
    "--limits",
    "limits_file",
    type=InputPath(dir_okay=False, path_type=Path),
    help="Collect the memory limits the phones stated in their logs into this registry (merged with what it "
    "holds), per ProductType × OS build × entitlement; `kvrig plan --limits` reads it.",
)
@click.option("--limits-only", is_flag=True, help="With --limits: collect the limits, fit no baseline.")
@click.option(
    "--include-virtual",
    is_flag=True,
    help="With --limits: keep what virtual iPhones stated too (the limit each was started with: for trying the "
    "registry out, never a real phone's fact; left out by default).",
)
@json_option
def calibrate(
    results: tuple[Path, ...],
    bundle: Path | None,
    model: Path | None,
    weights: str,
    out: Path,
    limits_file: Path | None,
    limits_only: bool,
    include_virtual: bool,
    as_json: bool,
) -> None:
    """Fit the app baseline per device profile from RESULTS.json files (kvrig soak, lab, demo): every
    telemetry footprint less the exact weights, KV and buffer cache. Use it with `kvrig plan --calibration`.
    With --limits, also collect the limit each phone stated into a limits registry."""
    from kvrig.calibration import calibrate as fit
    from kvrig.calibration import write_calibration

    if limits_only and limits_file is None:
        raise click.BadParameter("--limits-only needs --limits FILE", param_hint="--limits-only")
    if include_virtual and limits_file is None:
        raise click.BadParameter("--include-virtual needs --limits FILE", param_hint="--include-virtual")
    collected = _collect_limits(list(results), limits_file, include_virtual) if limits_file is not None else None
    if limits_only:
        assert collected is not None and limits_file is not None
        if as_json:
            echo_json(_limits_json(collected, limits_file))
        else:
            _render_limits(collected, limits_file)
        return
    calibration = fit(list(results), bundle=bundle, model=model, weights=weights)
    write_calibration(calibration, out)
    if as_json:
        if collected is None:
            echo_json(calibration)
        else:
            assert limits_file is not None
            echo_json({"calibration": calibration, "limits": _limits_json(collected, limits_file)})
        return
    if collected is not None and limits_file is not None:
        _render_limits(collected, limits_file)
    from rich.table import Table

    table = Table(title=f"Calibration → {out}", title_justify="left")
    for column in ("profile", "baseline", "profile estimate", "spread", "points", "sources"):
        table.add_column(column, justify="left" if column in ("profile", "sources") else "right")
    for name, entry in calibration.profiles.items():
        table.add_row(
            name,
            human_bytes(entry.baseline_bytes),
            human_bytes(entry.profile_baseline_bytes),
            human_bytes(entry.spread_bytes),
            str(entry.points),
            ", ".join(entry.sources),
        )
    console().print(table)


def _collect_limits(results: list[Path], limits_file: Path, include_virtual: bool):  # type: ignore[no-untyped-def]
    """Collects into the registry at limits_file (read first when it exists) and writes it back whole."""
    from kvrig.calibration import update_limits

    return update_limits(results, limits_file, include_virtual=include_virtual)


def _limits_json(collected, limits_file: Path) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The registry as written, and what the text output says beside it: how many runs went in, which were not."""
    return {
        "file": str(limits_file),
        "registry": collected.registry,
        "added": collected.added,
        "skipped": collected.skipped,
    }


def _render_limits(collected, limits_file: Path) -> None:  # type: ignore[no-untyped-def]
    from rich.table import Table

    table = Table(title=f"Limits the phones stated → {limits_file} ({collected.added} new runs)", title_justify="left")
    for column in ("ProductType", "build", "iOS", "entitled", "limit", "inactive", "runs"):
        table.add_column(column, justify="right" if column in ("limit", "inactive", "runs") else "left")
    for e in collected.registry.limits:
        table.add_row(
            e.product_type,
            e.build_version,
            e.os_version or "",
            "yes" if e.entitled else "no",
            human_bytes(e.limit_bytes) + ("" if len(e.seen_bytes) == 1 else " (runs disagree)"),
            human_bytes(e.inactive_bytes) if e.inactive_bytes else "",
            str(e.runs),
        )
    out = console()
    out.print(table)
    for line in collected.skipped:
        out.print(f"skipped: {line}", markup=False)
