"""`kvrig plan`: the memory plan for a model on a device."""

from __future__ import annotations

from pathlib import Path

import click

from kvrig.cli.options import backend_option, checked_specs, group_size_option, int_list, not_nan, ram_option
from kvrig.cli.output import console
from kvrig.cli.render import echo_json, human_bytes, json_option
from kvrig.recipes import DEFAULT_GROUP_SIZE, WEIGHT_CANDIDATES


def _buffer_cache(ctx: click.Context, param: click.Parameter, value: str) -> float | None:
    """MiB, or None for 'uncapped'."""
    if value.strip().lower() == "uncapped":
        return None
    try:
        mib = float(value)
    except ValueError:
        raise click.BadParameter(f"expected MiB (a number >= 0) or 'uncapped', got '{value}'") from None
    if not 0 <= mib < float("inf"):  # NaN too
        raise click.BadParameter(f"expected MiB (a number >= 0) or 'uncapped', got '{value}'")
    return mib


@click.command("plan", short_help="Plan memory for a model on a device: weights, KV cache per scheme, max context.")
@click.argument("model", required=False, type=click.Path(path_type=Path))
@click.option("--device", "-d", required=True, help="ProductType (iPhone16,1), profile name or profile file.")
@ram_option()
@click.option(
    "--kv",
    "--schemes",
    "schemes",
    callback=checked_specs("kv", auto=False, several=True),
    help="KV specs as package, demo and bench take them, e.g. fp16,k8v4,k6v4g32,k8v4+rot (default: all named, and a "
    "bundle's own); --schemes: its older name.",
)
@click.option("--contexts", callback=int_list, help="Contexts to list, e.g. 2048,8192.")
@click.option(
    "--weights",
    default="auto",
    show_default=True,
    callback=checked_specs("weights", auto=True, several=False),
    help="Weight recipe the budget uses. auto (as kvrig package): a bundle's own recipe, else the first recipe "
    f"package's auto tries ({WEIGHT_CANDIDATES[0]}), noted in the plan.",
)
@click.option(
    "--recipes",
    callback=checked_specs("weights", auto=False, several=True),
    help="Weight recipes to list (default q4,q8,mixed_4_6).",
)
@group_size_option("--group-size", DEFAULT_GROUP_SIZE, "Weight quantization group size (recipes that name none).")
@group_size_option(
    "--kv-group-size", None, "KV quantization group size for specs that name none (default 64, as kvrig package)."
)
@click.option("--dtype", default="float16", show_default=True, type=click.Choice(["float16", "bfloat16", "float32"]))
@click.option("--prefill-step", default=512, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--app",
    type=click.Choice(["kvrig", "uncapped"]),
    default="kvrig",
    show_default=True,
    help="The app's MLX buffer cache: kvrig (capped at --buffer-cache-mib, as kvrig's app does) or uncapped (an app "
    "that never sets Memory.cacheLimit: MLX's allocator replayed over the run).",
)
@click.option(
    "--buffer-cache-mib",
    "--buffer-cache-mb",
    "buffer_cache_mb",
    default="20",
    show_default=True,
    callback=_buffer_cache,
    help="The app's MLX buffer-cache cap in MiB, or 'uncapped' (the same as --app uncapped); --buffer-cache-mb: its "
    "older name.",
)
@click.option(
    "--generations",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Uncapped app: generations in a row (a chat's turns), the context growing evenly to each context.",
)
@click.option(
    "--decode-tokens",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Uncapped app: tokens each generation decodes one at a time (the rest of its context is prefilled).",
)
@click.option(
    "--margin",
    default=0.10,
    show_default=True,
    type=click.FloatRange(0, 1, max_open=True),
    callback=not_nan("a share of the limit in [0, 1)"),
)
@click.option(
    "--limit",
    type=click.Choice(["entitled", "default"]),
    default="entitled",
    show_default=True,
    help="entitled: the limit of an app with the increased-memory-limit entitlement (kvrig app declares it); "
    "default: without it.",
)
@click.option("--target-context", type=click.IntRange(min=1), help="Recommend for this context.")
@click.option(
    "--cap",
    default="trained",
    show_default=True,
    help="Upper bound on max context: 'trained' (max_position_embeddings), 'none' or a number.",
)
@click.option(
    "--quality",
    "quality_file",
    type=click.Path(path_type=Path),
    help="quality.json from `kvrig bench quality`: recommend only schemes within 2 % measured perplexity.",
)
@click.option(
    "--calibration",
    type=click.Path(path_type=Path),
    help="Calibration file from `kvrig calibrate`: use its measured baseline for this device's profile.",
)
@click.option(
    "--limits",
    "limits_file",
    type=click.Path(path_type=Path),
    help="Limits registry from `kvrig calibrate --limits`: plan against the limit the phone stated for this "
    "ProductType, OS build (--os-build) and entitlement (--limit) where it holds one, else the profile's.",
)
@click.option("--os-build", help="The OS build whose measured limit to use (default: the build measured last).")
@backend_option(
    "mlx", "coreml: bytes of the stateful Core ML program `kvrig export coreml` writes (weights, KV state)."
)
@click.option(
    "--mlx-backend",
    type=click.Choice(["metal", "cpu"]),
    default="metal",
    show_default=True,
    help="Where MLX runs the app: metal (the phone: fused attention) or cpu (the host runtime, the virtual "
    "iPhone: attention materializes the prefill scores).",
)
@click.option(
    "--weights-residency",
    type=click.Choice(["loaded", "mapped"]),
    help="How the app holds the weights: loaded (in the footprint) or mapped from the bundle's file (outside it; "
    "`kvrig package --weights-layout mapped`). Default: mapped for such a bundle, loaded otherwise.",
)
@json_option
def plan(
    model: Path | None,
    device: str,
    ram_gb: int | None,
    schemes: list[str] | None,
    contexts: list[int] | None,
    weights: str,
    recipes: list[str] | None,
    group_size: int,
    kv_group_size: int | None,
    dtype: str,
    prefill_step: int,
    app: str,
    buffer_cache_mb: float | None,
    generations: int,
    decode_tokens: int,
    margin: float,
    limit: str,
    target_context: int | None,
    cap: str,
    calibration: Path | None,
    limits_file: Path | None,
    os_build: str | None,
    quality_file: Path | None,
    backend: str,
    mlx_backend: str,
    weights_residency: str | None,
    as_json: bool,
) -> None:
    """Plan memory for MODEL on a device: exact weight bytes per recipe, KV bytes per scheme, the app memory
    limit and the max context each scheme holds, with a recommendation.

    MODEL is a model directory, a config.json or a GGUF file; omitted, the embedded SmolLM2-135M."""
    from kvrig.planner import PlanRequest, bundle_kv, bundle_residency
    from kvrig.planner import plan as make_plan
    from kvrig.planner.kv import ALL_NAMED_SCHEMES
    from kvrig.planner.memory import DEFAULT_CONTEXTS, MAX_CONTEXT
    from kvrig.planner.weights import DEFAULT_RECIPES
    from kvrig.profiles import device_ref

    device = device_ref(device, ram_gb)
    if backend == "coreml":
        from kvrig.cli.export import show_coreml_plan

        _refuse_options_coreml_ignores(click.get_current_context())
        contexts_listed = list(contexts or DEFAULT_CONTEXTS)
        show_coreml_plan(model, device, weights, group_size, contexts_listed, limit, as_json)
        return
    if cap == "trained":
        cap_value = None
    elif cap == "none":
        cap_value = MAX_CONTEXT
    else:
        try:
            cap_value = int(cap)
        except ValueError:
            cap_value = 0
        if not 1 <= cap_value <= MAX_CONTEXT:
            raise click.BadParameter(
                f"expected 'trained', 'none' or a number of tokens from 1 to {MAX_CONTEXT}, got '{cap}'",
                param_hint="--cap",
            )
    own_kv = bundle_kv(model)
    # A bundle's own KV spec is planned beside the named ones: it is the one its app will run.
    default_schemes = ALL_NAMED_SCHEMES + ((own_kv,) if own_kv and own_kv not in ALL_NAMED_SCHEMES else ())
    request = PlanRequest(
        schemes=tuple(schemes or default_schemes),
        weights=weights,
        recipes=tuple(recipes or DEFAULT_RECIPES),
        group_size=group_size,
        kv_group_size=kv_group_size,
        dtype=dtype,
        contexts=tuple(contexts or DEFAULT_CONTEXTS),
        prefill_step=prefill_step,
        buffer_cache_bytes=int((buffer_cache_mb or 0) * 1024 * 1024),
        app="uncapped" if buffer_cache_mb is None else app,  # type: ignore[arg-type]
        generations=generations,
        decode_tokens=decode_tokens,
        margin=margin,
        limit=limit,  # type: ignore[arg-type]
        target_context=target_context,
        max_context_cap=cap_value,
        backend=mlx_backend,  # type: ignore[arg-type]
        weights_residency=weights_residency or bundle_residency(model),  # type: ignore[arg-type]
    )
    if calibration is not None:
        from kvrig.calibration import calibrated_baseline
        from kvrig.profiles import load_profile

        entry = calibrated_baseline(calibration, load_profile(device).name)
        request = request.model_copy(
            update={"baseline_bytes": entry.baseline_bytes, "baseline_source": str(calibration)}
        )
    if os_build is not None and limits_file is None:
        raise click.BadParameter("--os-build picks a measured limit: give --limits FILE too", param_hint="--os-build")
    if limits_file is not None:
        request = _measured_limit(request, device, limits_file, os_build)
    result = make_plan(model, device, request)
    if quality_file is not None:
        from kvrig.quality.plan_hook import apply_quality

        result = apply_quality(result, quality_file)
    if as_json:
        echo_json(result)
        return
    render_plan(result, own_kv)


# What `--backend coreml` plans: the exported program's weights and fp16 state at each context, against the limit.
_COREML_OPTIONS = {"model", "device", "ram_gb", "weights", "group_size", "contexts", "limit", "backend", "as_json"}


def _refuse_options_coreml_ignores(ctx: click.Context) -> None:
    """A usage error naming the options given that a Core ML plan cannot honour (it used to drop them silently,
    files that do not exist included)."""
    from click.core import ParameterSource

    given = [
        param.opts[0]
        for param in ctx.command.params
        if param.name not in _COREML_OPTIONS
        and ctx.get_parameter_source(param.name or "") not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    ]
    if given:
        raise click.UsageError(
            f"--backend coreml plans the exported program's weights and float16 state against the app limit; "
            f"{', '.join(given)} apply to MLX plans only"
        )


def _measured_limit(request, device: str, limits_file: Path, os_build: str | None):  # type: ignore[no-untyped-def]
    """The request with the limit the registry measured for this device, build and entitlement, if it has one;
    otherwise unchanged (the plan then says it used the profile's)."""
    from kvrig.planner.limits import describe, load_limits, lookup, product_types
    from kvrig.profiles import load_profile

    registry = load_limits(limits_file)
    entry = lookup(registry, product_types(device, load_profile(device)), os_build, request.limit)
    if entry is None:
        return request
    return request.model_copy(
        update={"measured_limit_bytes": entry.limit_bytes, "measured_limit_source": describe(entry, limits_file)}
    )


def render_plan(p, own_kv: str | None = None) -> None:  # type: ignore[no-untyped-def]
    """The plan as tables; `own_kv`: the KV spec of the bundle planned (its row is marked)."""
    from rich.table import Table

    from kvrig.profiles import INCREASED_MEMORY_LIMIT

    out = console()
    m, d = p.model, p.device
    out.print(
        f"[bold]{Path(m.source).name}[/] ({m.model_type}, {m.layers} layers: "
        + ", ".join(f"{n} {k}" for k, n in m.layer_kinds.items())
        + f"; {m.parameters / 1e6:.0f}M parameters) on [bold]{d.marketing_name}[/] ({', '.join(d.product_types)}, "
        f"{human_bytes(d.ram_bytes)} RAM)"
    )
    if len(d.ram_configurations_gb) > 1:
        sizes = " and ".join(f"{gb} GB" for gb in sorted(d.ram_configurations_gb))
        chosen = d.ram_configurations_gb[0]
        out.print(f"Sold with {sizes} under these ProductTypes: this plan is for {chosen} GB (--ram N chooses)")
    entitled = human_bytes(d.limit_entitled_bytes) if d.limit_entitled_bytes else "unknown"
    # A limit a phone stated differs from the profile's: say whose each number is.
    whose = ("the profile's: " if p.limit_measured_from else "") + f"default {human_bytes(d.limit_default_bytes)}"
    against = ("the stated " if p.limit_measured_from else "") + f"{p.limit_kind} {human_bytes(p.limit_bytes)}"
    out.print(
        f"App memory limit: {whose}, entitled {entitled}; planning against {against} − {p.margin:.0%} margin = "
        f"{human_bytes(p.budget_bytes)}"
    )
    if p.limit_measured_from:
        said = f"  the {p.limit_kind} limit is what the phone stated in its log: {p.limit_measured_from}"
        out.print(said, markup=False)
    else:
        out.print("  the limit is the device profile's: no limit a phone stated for it (`--limits FILE`) is used")
    # iOS's rule, in the words the lab's limit_source uses (kvrig.lab.predict.limit_kind).
    if p.limit_requires:
        out.print(
            f"  the entitled limit: an app gets it when it declares {p.limit_requires} (kvrig app's projects do); "
            "--limit default plans for an app that does not",
            markup=False,
        )
    elif d.limit_entitled_bytes:
        out.print(
            f"  the default limit: an app gets it when it does not declare {INCREASED_MEMORY_LIMIT}; "
            "--limit entitled plans for one that does (kvrig app's projects do)",
            markup=False,
        )
    else:
        out.print(
            f"  the default limit: the profile knows no entitled limit, so an app declaring {INCREASED_MEMORY_LIMIT} "
            "is planned with the default one too",
            markup=False,
        )
    rt = p.runtime
    cache = (
        f"uncapped ({rt.generations} generation(s), {rt.decode_tokens} decoded each)"
        if rt.app == "uncapped"
        else human_bytes(rt.buffer_cache_bytes)
    )
    out.print(
        f"Runtime: app {rt.app}, MLX buffer cache "
        f"{cache}, baseline {human_bytes(p.runtime.baseline_bytes)} "
        + ("(calibrated), " if p.runtime.baseline_calibrated_from else "(estimate), ")
        + f"prefill step {p.runtime.prefill_step}, MLX on {p.runtime.backend}"
    )
    if p.mapped is not None:
        mc = p.mapped
        verdict = "within" if mc.within_ceiling else "[bold red]OVER[/]"
        headroom = mc.ram_headroom_bytes
        shown = human_bytes(headroom) if headroom >= 0 else "-" + human_bytes(-headroom)
        out.print(
            f"Weights mapped from the file: {human_bytes(mc.mapped_bytes)} outside the footprint, {verdict} the "
            f"mapped-memory ceiling {human_bytes(mc.ceiling_bytes)}; RAM headroom beside the largest footprint {shown}"
        )
    weights = Table(title="Weights", title_justify="left")
    weights.add_column("recipe")
    weights.add_column("bytes", justify="right")
    for name, b in p.weights_by_recipe.items():
        mark = " ◀ used" if name == p.weights_recipe else ""
        weights.add_row(f"{name} (g{p.group_size}){mark}", human_bytes(b))
    for name in p.weights_unavailable:
        weights.add_row(f"{name} (g{p.group_size})", "unavailable")
    out.print(weights)
    for name, reason in p.weights_unavailable.items():
        out.print(f"  {name} unavailable for {m.model_type}: {reason}", markup=False)

    contexts = list(next(iter(p.kv_bytes.values())).keys())
    kv = Table(title="KV cache by scheme", title_justify="left")
    kv.add_column("scheme")
    kv.add_column("bytes/token", justify="right")
    for c in contexts:
        kv.add_column(f"@{c}", justify="right")
    kv.add_column("max context", justify="right")
    kv.add_column("default limit", justify="right")
    for name, per_token in p.kv_bytes_per_token.items():
        bound = p.limited_by[name]
        kv.add_row(
            name + (" ◀ bundle" if name == own_kv else ""),
            f"{per_token:,}",
            *[human_bytes(p.kv_bytes[name][c]) for c in contexts],
            f"{p.max_context[name]:,} ({bound})",
            f"{p.max_context_default_limit[name]:,}",
        )
    out.print(kv)
    if p.buffer_cache_by_context:
        held = Table(title="MLX buffer cache an uncapped app holds by context", title_justify="left")
        held.add_column("scheme")
        for c in contexts:
            held.add_column(f"@{c}", justify="right")
        for name, row in p.buffer_cache_by_context.items():
            held.add_row(name, *[human_bytes(row[c]) for c in contexts])
        out.print(held)

    tps = Table(
        title="Decode ceiling, tok/s (bandwidth / bytes read per token — a ceiling, not a forecast)",
        title_justify="left",
    )
    tps.add_column("scheme")
    for c in contexts:
        tps.add_column(f"@{c}", justify="right")
    for name, row in p.decode_tps_ceiling.items():
        tps.add_row(name, *[f"{row[c]:.0f}" for c in contexts])
    out.print(tps)

    r = p.recommendation
    out.print(f"[bold green]Recommendation:[/] {r.scheme} — max context {r.max_context:,}")
    for reason in r.reasons:
        out.print(f"  • {reason}")
    for note in p.notes:
        out.print(f"[dim]note: {note}[/]")


@click.command("plan", short_help="Time and memory of planning, side by side with doing the same for real.")
@click.argument("model", required=False, type=click.Path(path_type=Path))
@click.option("--device", "-d", default="iPhone16,1", show_default=True, help="ProductType, profile name or file.")
@ram_option()
@click.option("--no-real", is_flag=True, help="Skip the evaluated KV and the measured prefill (large models).")
@json_option
def plan_bench(model: Path | None, device: str, ram_gb: int | None, no_real: bool, as_json: bool) -> None:
    """Time and memory of planning MODEL (default: the embedded SmolLM2), side by side with doing the same
    for real: MLX's peak memory and Python's while planning, the lazily answered KV bytes at 8192 tokens
    against the evaluated caches, and the prefill transient measured on the real model against the plan's."""
    from kvrig.runtime.blas import ensure_openblas

    if not no_real:
        ensure_openblas()  # the measured prefill runs float matmuls on the CPU
    from kvrig.planner.bench import benchmark_plan
    from kvrig.profiles import device_ref

    b = benchmark_plan(model, device_ref(device, ram_gb), real=not no_real)
    if as_json:
        echo_json(b.to_dict())
        return
    click.echo(
        f"{Path(b.model).name}: plan {b.plan_seconds:.2f} s; MLX peak {b.plan_mlx_peak_bytes:,} B, "
        f"Python peak {human_bytes(b.plan_python_peak_bytes)}"
    )
    click.echo(
        f"KV at {b.kv_context} tokens (fp16): {b.kv_bytes_lazy:,} B answered lazily in "
        f"{b.kv_lazy_seconds:.3f} s with {b.kv_lazy_mlx_peak_bytes:,} B of MLX memory"
    )
    if b.kv_bytes_evaluated is not None and b.kv_evaluated_mlx_peak_bytes:
        click.echo(
            f"  evaluated for real: {b.kv_bytes_evaluated:,} B, MLX peak {b.kv_evaluated_mlx_peak_bytes:,} B "
            f"(lazy allocates {b.kv_lazy_mlx_peak_bytes / b.kv_evaluated_mlx_peak_bytes:.2e} of it)"
        )
    if b.transient_measured_bytes is not None and b.transient_planned_bytes:
        click.echo(
            f"Prefill transient at {b.transient_context} (512-token chunk, float32, CPU): measured "
            f"{human_bytes(b.transient_measured_bytes)}, planned for the CPU backend "
            f"{human_bytes(b.transient_planned_bytes)} "
            f"(measured/planned {b.transient_measured_bytes / b.transient_planned_bytes:.2f}); "
            f"planned for Metal (fused attention) {human_bytes(b.transient_planned_metal_bytes or 0)}"
        )
