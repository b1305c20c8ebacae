"""`kvrig demo`: the main job on a virtual iPhone, from packaging to the jetsam report."""

from __future__ import annotations

from pathlib import Path

import click

from toolchain.cli.render import echo_json, human_bytes, json_option


@click.command(
    "demo",
    short_help="The main job on a virtual iPhone: package, plan, build, deploy, soak until jetsam, compare.",
)
@click.option(
    "-o", "--out", type=click.Path(file_okay=False, path_type=Path), default=Path("build/demo"), show_default=True
)
@click.option("--device", default="iPhone16,1", show_default=True, help="ProductType or profile of the virtual iPhone.")
@click.option("--weights", default="q4", show_default=True, help="Weight recipe for `kvrig package`.")
@click.option("--kv", default="k8v4", show_default=True, help="KV scheme.")
@click.option(
    "--room-tokens",
    type=click.IntRange(min=256),
    default=2048,
    show_default=True,
    help="The virtual iPhone's limit leaves room for this much KV beyond weights, buffer cache and baseline.",
)
@click.option("--decode-tokens", type=click.IntRange(min=1), default=4, show_default=True, help="Timed per step.")
@json_option
def demo(out: Path, device: str, weights: str, kv: str, room_tokens: int, decode_tokens: int, as_json: bool) -> None:
    """Package SmolLM2, plan it, build its app for a virtual iPhone with a small limit, deploy, soak until
    jetsam, and print the predicted vs measured max context and the jetsam report's footprint."""
    from toolchain.demo import DemoOptions, run_demo

    options = DemoOptions(
        out=out, device=device, weights=weights, kv=kv, room_tokens=room_tokens, decode_tokens=decode_tokens
    )
    result = run_demo(options, on_event=None if as_json else lambda line: click.echo(f"  {line}", err=True))
    soak = result.soak
    last_tps = next((p.decode_tps for p in reversed(soak.tps_curve) if p.decode_tps), None)
    if as_json:
        echo_json(
            {
                "bundle": str(result.bundle),
                "ipa": str(result.ipa),
                "device": result.device,
                "limit_bytes": result.limit_bytes,
                "predicted_max_context": result.predicted_max_context,
                "predicted_max_context_with_margin": result.predicted_max_context_with_margin,
                "predicted_footprint_bytes": result.predicted_footprint_bytes,
                "outcome": soak.outcome,
                "max_safe_context": soak.max_safe_context,
                "max_context_reached": soak.max_context_reached,
                "footprint_at_kill_bytes": soak.footprint_at_kill_bytes,
                "limit_from_report_bytes": soak.limit_bytes,
                "decode_tps_last": last_tps,
                "soak_dir": str(result.soak_dir),
            }
        )
        return
    rows = [
        ("virtual iPhone", f"{result.device}, app limit {human_bytes(result.limit_bytes)}"),
        ("outcome", f"{soak.outcome} ({soak.outcome_detail})"),
        ("predicted max context (plan, no margin)", str(result.predicted_max_context)),
        (f"  with the plan's {result.margin:.0%} margin", str(result.predicted_max_context_with_margin)),
        ("measured max safe context", str(soak.max_safe_context)),
        ("footprint at kill (JetsamEvent report)", human_bytes(soak.footprint_at_kill_bytes or 0)),
        ("planned footprint at the predicted context", human_bytes(result.predicted_footprint_bytes)),
        ("decode tok/s at the last step (host CPU)", f"{last_tps:.1f}" if last_tps else "-"),
        ("results", str(result.soak_dir / "results.json")),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")
    click.echo(
        "note: the plan counts prefill activations as an upper-bound estimate; the virtual iPhone samples the "
        "footprint between forward passes, so transients inside a pass are not in it."
    )
