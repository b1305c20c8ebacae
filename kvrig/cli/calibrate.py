"""`kvrig calibrate`: fit the planner's baseline per device profile to measured soaks."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvrig.cli.output import console
from kvrig.cli.render import echo_json, human_bytes, json_option


@click.command(
    "calibrate",
    short_help="Fit the planner's baseline per device profile to measured soaks; write calibration.json.",
)
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--bundle", type=click.Path(path_type=Path), help="Bundle the runs ran (default: the one each names).")
@click.option("--model", type=click.Path(path_type=Path), help="Model for runs without a bundle (dir, config, GGUF).")
@click.option("--weights", default="q4", show_default=True, help="Weight recipe with --model.")
@click.option("-o", "--out", type=click.Path(path_type=Path), default=Path("calibration.json"), show_default=True)
@json_option
def calibrate(
    results: tuple[Path, ...], bundle: Path | None, model: Path | None, weights: str, out: Path, as_json: bool
) -> None:
    """Fit the app baseline per device profile from RESULTS.json files (kvrig soak, lab, demo): every
    telemetry footprint less the exact weights, KV and buffer cache. Use it with `kvrig plan --calibration`."""
    from kvrig.calibration import calibrate as fit

    calibration = fit(list(results), bundle=bundle, model=model, weights=weights)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(calibration.model_dump(mode="json", by_alias=True), indent=2) + "\n")
    if as_json:
        echo_json(calibration)
        return
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
