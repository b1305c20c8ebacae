"""`kvrig soak`: run one soak on a device and write results.json, telemetry and jetsam reports to a folder."""

from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource

from kvrig.cli.device import parse_tunnel, phone_address, tunnel_option
from kvrig.cli.options import InputPath, backend_option, seconds_option, tokens_option
from kvrig.cli.output import info
from kvrig.cli.render import echo_json, human_bytes, json_option, usbmuxd_option
from kvrig.device.loop import run_async


@click.command(
    "soak",
    short_help="Grow the app's context on a device until it completes or jetsam kills it; write results.json.",
)
@click.option("--app-id", required=True, help="Bundle id of the installed app to soak.")
@click.option("--udid", default=None, help="The device's UDID (needed when several are attached).")
@click.option(
    "--plan", "plan_file", type=InputPath(exists=True, dir_okay=False, path_type=Path), help="A soak plan file."
)
@tokens_option("--max-tokens", 131072, "Stop growing here.")
@tokens_option("--step-tokens", 256, "Tokens added per step (the soak plan's step_tokens).", alias="--step")
@tokens_option("--decode-tokens", 16, "Tokens timed per step.")
@backend_option(
    None,
    "Runtime the app soaks: MLX (default) or the Core ML program `kvrig app --coreml` shipped; overrides the plan "
    "file's.",
)
@click.option(
    "--weights-residency",
    type=click.Choice(["loaded", "mapped"]),
    default=None,
    help="How the app holds the weights: loaded into MLX's memory, or mapped from the bundle's file (a bundle packaged "
    "with --weights-layout mapped); default: as the bundle says. Overrides the plan file's.",
)
@click.option(
    "--buffer-cache",
    type=click.Choice(["capped", "uncapped"]),
    default=None,
    help="MLX's buffer cache this run: capped at the bundle's buffer_cache_limit_bytes (kvrig's app, the default), or "
    "uncapped and never emptied, as an app kvrig did not write runs (planned with `kvrig plan --app uncapped`). "
    "Overrides the plan file's.",
)
@click.option(
    "--on-critical",
    type=click.Choice(["stop_and_save", "continue"]),
    default=None,
    help="What the app does at critical memory pressure: stop and save as its bundle's pressure policy says (the "
    "default), or keep growing into the kernel's limit to find where jetsam kills it. Overrides the plan file's.",
)
@click.option("--bundle", "bundle_name", default=None, help="Name of the model bundle the app runs (recorded).")
@click.option(
    "--scheme",
    default=None,
    help="KV scheme recorded with the run (default: the one the app reports its bundle runs, from kvcache.json). "
    "Overrides the plan file's.",
)
@seconds_option(
    "--hang-after", 120.0, "Seconds without telemetry (app alive) before the run counts as hung.", minimum=0.1
)
@seconds_option("--timeout", None, "Seconds for the whole run.", minimum=1)
@tunnel_option
@usbmuxd_option
@seconds_option(
    "--reconnect",
    30.0,
    "Seconds a dropped tunnel or an unplugged phone may take to come back before the run ends as lost.",
    minimum=0,
    dest="reconnect_s",
)
@seconds_option(
    "--handshake-timeout", 20.0, "Seconds the phone gets to finish the tunnel handshake (iOS 17+).", minimum=0.1
)
@seconds_option(
    "--battery-interval", 5.0, "Seconds between battery temperature/level reads (diagnostics relay).", minimum=0.5
)
@seconds_option(
    "--report-wait",
    10.0,
    "Seconds the phone gets to file a JetsamEvent or crash report after the app dies (none filed: the device log "
    "tells the end).",
    minimum=0,
    dest="report_wait_s",
)
@click.option(
    "--background",
    "background",
    default="",
    metavar="PHASES",
    help="Send the app to the background during these phases (prefill, decode; comma-separated): another app "
    "is launched through the developer services, then the app is brought back; results.json says what it did.",
)
@seconds_option("--background-s", 5.0, "Seconds the app stays in the background each time.", minimum=0.1)
@click.option(
    "-o",
    "--out",
    "--output",
    "out_dir",
    type=click.Path(path_type=Path),  # a file there is the library's OutputWriteError (38), as for every output folder
    required=True,
    help="Output folder (results.json, telemetry.jsonl, reports/).",
)
@json_option
def soak(
    app_id: str,
    udid: str | None,
    plan_file: Path | None,
    max_tokens: int,
    step_tokens: int,
    decode_tokens: int,
    backend: str | None,
    weights_residency: str | None,
    buffer_cache: str | None,
    on_critical: str | None,
    bundle_name: str | None,
    scheme: str | None,
    hang_after: float,
    timeout: float | None,
    tunnel: str,
    usbmuxd: tuple[str, ...],
    reconnect_s: float,
    handshake_timeout: float,
    battery_interval: float,
    report_wait_s: float,
    background: str,
    background_s: float,
    out_dir: Path,
    as_json: bool,
) -> None:
    """Grow the app's context until it completes or iOS kills it; pull telemetry and the jetsam report."""
    from kvrig.schemas import load_model_file
    from kvrig.schemas.soakplan import SoakPlan
    from kvrig.soaking.analyse import raise_for
    from kvrig.soaking.background import parse_phases
    from kvrig.soaking.driver import SoakOptions
    from kvrig.soaking.driver import soak as run
    from kvrig.soaking.plan import make_plan, with_overrides

    try:
        phases = parse_phases(background)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--background") from None

    if plan_file is not None:
        context = click.get_current_context()
        given = [
            f"--{n.replace('_', '-')}" for n in ("max_tokens", "step_tokens", "decode_tokens") if _given(context, n)
        ]
        if given:  # the file's schedule would win without a word
            raise click.UsageError(
                f"{', '.join(given)} with --plan: the plan file sets the growth schedule; edit {plan_file} or leave "
                "out --plan"
            )
        plan = load_model_file(SoakPlan, plan_file)
    else:
        plan = make_plan(max_tokens=max_tokens, step_tokens=step_tokens, decode_tokens=decode_tokens)
    plan = with_overrides(
        plan,
        scheme=scheme,
        backend=backend,
        weights_residency=weights_residency,
        buffer_cache=buffer_cache,
        on_critical=on_critical,
    )
    echo = None if as_json else info
    options = SoakOptions(
        hang_after_s=hang_after,
        timeout_s=timeout,
        reconnect_s=reconnect_s,
        bundle=bundle_name,
        on_event=echo,
        battery_interval_s=battery_interval,
        report_wait_s=report_wait_s,
        tunnel=parse_tunnel(tunnel),
        handshake_timeout_s=handshake_timeout,
        background=phases,
        background_s=background_s,
    )
    address = phone_address(udid, usbmuxd)
    result = run_async(run(app_id, plan, out_dir, udid=udid, options=options, usbmux_address=address))
    if as_json:
        echo_json(result)
    else:
        _render(result, out_dir)
    raise_for(result, out_dir / "results.json")


def _render(result, out_dir: Path) -> None:  # type: ignore[no-untyped-def]
    def size(n: int | None) -> str:
        return human_bytes(n) if n is not None else "?"

    click.echo(f"run {result.run_id} on {result.device.udid} ({result.device.product_type}): {result.outcome}")
    click.echo(f"  {result.outcome_detail}")
    for e in result.evidence:
        where = e.file or e.line
        click.echo(f"  evidence ({e.kind}): {e.detail}" + (f": {where}" if where else ""))
    stated = result.stated_limit
    if stated is not None and stated.limit_bytes is not None:
        entitled = {True: "entitled", False: "not entitled", None: "entitlement unknown"}[stated.entitled]
        click.echo(
            f"  the phone stated a limit of {size(stated.limit_bytes)} ({stated.product_type}, build "
            f"{stated.build_version}, {entitled})"
        )
    click.echo(f"  max context reached {result.max_context_reached}, max safe context {result.max_safe_context}")
    if result.footprint_at_kill_bytes is not None:
        click.echo(
            f"  footprint at kill {size(result.footprint_at_kill_bytes)}, "
            f"limit implied by the report {size(result.limit_bytes)}, app believed {size(result.app_limit_bytes)}"
        )
    if result.weights_residency is not None:
        mapped = f", {size(result.mapped_weight_bytes)} mapped" if result.weights_residency == "mapped" else ""
        why = f" ({result.residency_note})" if result.residency_note else ""
        click.echo(f"  weights {result.weights_residency}{mapped}{why}")
    points = [p for p in result.tps_curve if p.decode_tps is not None]
    if points:
        shown = points[:: max(1, len(points) // 8)]
        click.echo("  decode tok/s: " + ", ".join(f"{p.context_tokens}:{p.decode_tps:.1f}" for p in shown))
    if result.tunnel is not None:
        click.echo(f"  tunnel: {result.tunnel.kind} ({result.tunnel.reason}), opened {result.tunnel.opened}x")
    for i in result.interruptions:
        state = f"resumed after {i.after_s:g} s" if i.resumed and i.after_s is not None else "did not come back"
        click.echo(f"  interrupted ({i.cause}): {state}")
    for b in result.background:
        click.echo(f"  background during {b.requested}: {b.result} ({b.evidence})")
    temps = [b.temperature_c for b in result.battery if b.temperature_c is not None]
    if temps:
        click.echo(f"  battery {temps[0]:.1f} -> {temps[-1]:.1f} °C (max {max(temps):.1f}) over {len(temps)} reads")
    click.echo(f"  results: {out_dir / 'results.json'}")


def _given(context: click.Context, name: str) -> bool:
    return context.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)
