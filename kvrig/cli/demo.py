"""`kvrig demo`: the main job on a virtual iPhone, from packaging to the jetsam report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvrig.cli.options import checked_specs, int_list, ios_option, tokens_option
from kvrig.cli.output import console, info
from kvrig.cli.render import echo_json, human_bytes, json_option

if TYPE_CHECKING:
    from kvrig.demo import DemoResult


@click.command(
    "demo",
    short_help="The main job on a virtual iPhone: package, plan, build, deploy, soak until jetsam, compare.",
)
@click.option(
    "-o",
    "--out",
    "--output",
    "out",
    type=click.Path(path_type=Path),
    default=Path("build/demo"),
    show_default=True,
)
@click.option("--device", default="iPhone16,1", show_default=True, help="ProductType or profile of the virtual iPhone.")
@click.option(
    "--weights",
    default="auto",
    show_default=True,
    callback=checked_specs("weights", auto=True, several=False),
    help="Weight recipe as `kvrig package --weights` takes it.",
)
@click.option(
    "--kv",
    default="auto",
    show_default=True,
    callback=checked_specs("kv", auto=True, several=True),
    help="KV spec as `kvrig package --kv` takes it, or several: auto,fp16,k8v8,k4v4+rot.",
)
@click.option(
    "--prefill-step",
    default="512",
    show_default=True,
    callback=int_list,
    help="Prefill step size (kvcache.json), or several: 256,512.",
)
@tokens_option(
    "--room-tokens",
    2048,
    "The virtual iPhone's limit is the plan's peak footprint at this context (KV, transients and all).",
    minimum=256,
)
@tokens_option("--step-tokens", 256, "Context added per soak step.")
@tokens_option("--decode-tokens", 4, "Timed per step.")
@ios_option("18.6", "The virtual iPhone's iOS; from 17.4 the app is launched through the CoreDeviceProxy tunnel.")
@click.option(
    "--app-runtime",
    type=click.Choice(["auto", "swift", "python"]),
    default="auto",
    show_default=True,
    help="What the virtual iPhone runs: the app's Swift engine compiled for this host (`kvrig engine`), kvrig's "
    "Python LLM runtime, or auto: Swift when it can be built here (KVRIG_SWIFT_DEPS), else Python.",
)
@json_option
def demo(
    out: Path,
    device: str,
    weights: str,
    kv: list[str],
    prefill_step: list[int],
    room_tokens: int,
    step_tokens: int,
    decode_tokens: int,
    ios: str,
    app_runtime: str,
    as_json: bool,
) -> None:
    """Package SmolLM2, plan it, build its app for a virtual iPhone with a small limit, deploy, soak until
    jetsam, and print the planned vs measured max context and the jetsam report's footprint against the limit.
    With several schemes or prefill steps, one run each (own folder under OUT) and a table side by side."""
    from kvrig.runtime.blas import ensure_openblas

    ensure_openblas()  # packaging measures and quantizes with float matmuls, as `kvrig package` does
    from kvrig.demo import DemoOptions, run_demos

    options = DemoOptions(
        out=out,
        device=device,
        weights=weights,
        room_tokens=room_tokens,
        step_tokens=step_tokens,
        decode_tokens=decode_tokens,
        ios=ios,
        app_runtime=app_runtime,
    )
    say = None if as_json else (lambda tag, line: info(f"  [{tag}] {line}"))
    results = run_demos(options, kv, prefill_step, on_event=say)
    if as_json:
        echo_json([_as_dict(r) for r in results] if len(results) > 1 else _as_dict(results[0]))
        return
    if len(results) == 1:
        _render_one(results[0])
    else:
        _render_table(results)


def _as_dict(result: DemoResult) -> dict[str, Any]:
    soak = result.soak
    last_tps = next((p.decode_tps for p in reversed(soak.tps_curve) if p.decode_tps), None)
    killed = result.killed_in_step
    return {
        "bundle": str(result.bundle),
        "ipa": str(result.ipa),
        "device": result.device,
        "kv": result.kv,
        "prefill_step": result.prefill_step,
        "step_tokens": result.step_tokens,
        "limit_bytes": result.limit_bytes,
        "predicted_max_context": result.predicted_max_context,
        "predicted_max_context_with_margin": result.predicted_max_context_with_margin,
        "predicted_footprint_bytes": result.predicted_footprint_bytes,
        "margin": result.margin,
        "outcome": soak.outcome,
        "outcome_detail": soak.outcome_detail,
        "max_safe_context": soak.max_safe_context,
        "killed_growing_from": killed[0] if killed else None,
        "killed_growing_to": killed[1] if killed else None,
        "plan_within_one_step": result.plan_within_one_step,
        "max_context_reached": soak.max_context_reached,
        "footprint_at_kill_bytes": soak.footprint_at_kill_bytes,
        "kill_footprint_over_limit_bytes": result.kill_footprint_over_limit_bytes,
        "limit_from_report_bytes": soak.limit_bytes,
        "decode_tps_last": last_tps,
        "ios": result.ios,
        "app_runtime": result.app_runtime,
        "app_runtime_why": result.app_runtime_why,
        "buffer_cache_bytes": result.buffer_cache_bytes,
        "buffer_cache_limit_bytes": result.buffer_cache_limit_bytes,
        "tunnel": soak.tunnel.kind if soak.tunnel else None,
        "battery_samples": len(soak.battery),
        "battery_max_temperature_c": _max_temperature(result),
        "soak_dir": str(result.soak_dir),
    }


def _max_temperature(result: DemoResult) -> float | None:
    temps = [b.temperature_c for b in result.soak.battery if b.temperature_c is not None]
    return max(temps) if temps else None


def _render_one(result: DemoResult) -> None:
    soak = result.soak
    last_tps = next((p.decode_tps for p in reversed(soak.tps_curve) if p.decode_tps), None)
    killed = result.killed_in_step
    over = result.kill_footprint_over_limit_bytes
    rows = [
        (
            "virtual iPhone",
            f"{result.device}, iOS {result.ios}, app limit {human_bytes(result.limit_bytes)} ({result.limit_bytes} B)",
        ),
        ("app runtime", result.app_runtime_why),
        (
            "MLX buffer cache (planned: measured)",
            f"{human_bytes(result.buffer_cache_bytes)} kept under the bundle's cap of "
            f"{human_bytes(result.buffer_cache_limit_bytes)}",
        ),
        ("developer services through", soak.tunnel.kind if soak.tunnel else "-"),
        ("KV spec, prefill step, soak step", f"{result.kv}, {result.prefill_step}, {result.step_tokens} tokens"),
        ("outcome", f"{soak.outcome} ({soak.outcome_detail})"),
        ("planned max context (no margin)", str(result.predicted_max_context)),
        (f"  with the plan's {result.margin:.0%} margin", str(result.predicted_max_context_with_margin)),
        (
            "measured: killed in the step",
            f"{killed[0]} -> {killed[1]} tokens" if killed else f"no kill (max safe context {soak.max_safe_context})",
        ),
        ("plan within one soak step of the kill", _yes_no(result.plan_within_one_step)),
        (
            "footprint at kill (JetsamEvent report)",
            f"{human_bytes(soak.footprint_at_kill_bytes or 0)} ({soak.footprint_at_kill_bytes} B, "
            f"limit {'+' if (over or 0) >= 0 else ''}{over} B)"
            if soak.footprint_at_kill_bytes is not None
            else "-",
        ),
        ("planned footprint at the planned context", human_bytes(result.predicted_footprint_bytes)),
        ("decode tok/s at the last step (host CPU)", f"{last_tps:.1f}" if last_tps else "-"),
        (
            "battery (diagnostics relay)",
            f"{len(soak.battery)} samples, up to {_max_temperature(result)} °C" if soak.battery else "-",
        ),
        ("results", str(result.soak_dir / "results.json")),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


def _render_table(results: list[DemoResult]) -> None:
    from rich.table import Table

    table = Table(
        "kv", "prefill", "limit", "planned", "killed in step", "within 1 step", "report - limit", "outcome", box=None
    )
    for r in results:
        killed = r.killed_in_step
        over = r.kill_footprint_over_limit_bytes
        table.add_row(
            r.kv,
            str(r.prefill_step),
            human_bytes(r.limit_bytes),
            str(r.predicted_max_context),
            f"{killed[0]}->{killed[1]}" if killed else "-",
            _yes_no(r.plan_within_one_step),
            f"{over:+d} B" if over is not None else "-",
            str(r.soak.outcome),
        )
    console().print(table)
    click.echo(f"soak step {results[0].step_tokens} tokens; planned = the plan's max context without its margin")
    click.echo(f"app runtime: {results[0].app_runtime_why}")
    first = results[0]
    click.echo(
        f"MLX buffer cache planned: {human_bytes(first.buffer_cache_bytes)} (what the app's MLX keeps here, measured; "
        f"the bundle's cap is {human_bytes(first.buffer_cache_limit_bytes)})"
    )


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")
