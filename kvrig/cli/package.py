"""`kvrig package`: quantize a model into a bundle ready to push to the phone."""

from __future__ import annotations

from pathlib import Path

import click

from kvrig.cli.options import checked_specs, group_size_option, not_nan, ram_option, retired_force_option
from kvrig.cli.output import OUTPUT, info, warn
from kvrig.cli.render import echo_json, human_bytes, json_option
from kvrig.recipes import DEFAULT_GROUP_SIZE, WEIGHT_CANDIDATES


@click.command("package", short_help="Quantize a model into a bundle for the phone (weights, kvcache.json, manifest).")
@click.argument("model", required=False, type=click.Path(path_type=Path))
@click.option("--device", "-d", help="Device profile to plan for (refuses a bundle that does not fit).")
@ram_option()
@click.option(
    "--weights",
    default="auto",
    show_default=True,
    callback=checked_specs("weights", auto=True, several=False),
    help="Weight recipe: qN[gG], mixed_X_Y, fp16, awq-qN, gptq-qN, imx-qN, gpx-qN, imx-BPW, gpx-BPW "
    "(a target bits per weight, 3.5 to 8: gpx-4.6, gpx-4.0), dq-BPW; a quantized one +kd[N] distils its scales "
    "against the float model (N steps, minutes on a CPU). "
    f"auto: the smallest of {', '.join(WEIGHT_CANDIDATES)} whose bundle passes the quality gate, measured here.",
)
@click.option(
    "--fit",
    type=click.IntRange(1),
    help="With --device: choose weights and KV spec that hold this many tokens there, best measured quality first "
    "(prints every pair considered and why the winner won; refuses naming the closest option).",
)
@group_size_option("--group-size", DEFAULT_GROUP_SIZE, "Weight quantization group size (recipes that name none).")
@click.option(
    "--weights-layout",
    type=click.Choice(["loaded", "mapped"]),
    default="loaded",
    show_default=True,
    help="mapped: every tensor starts on a 16 KiB page, so the app maps the weights from the file and iOS counts "
    "them outside its footprint (MLX loads the file as usual; strict safetensors readers refuse the gaps).",
)
@click.option(
    "--kv",
    default="auto",
    show_default=True,
    callback=checked_specs("kv", auto=True, several=False),
    help="KV spec: fp16, kXvY[gZ] (k8v4, k6v4g32) with +kN@L1.L2 / +kN@topM (keys of some layers at N bits), "
    "+rot / +rotk (Hadamard rotation of keys and values / keys), +sN (sink tokens), +wN (recent window). auto: "
    "k8v4 and k8v4+rot measured on the model, the one whose perplexity rises least within 2 %, else k8v8, else fp16 "
    "(with --no-quality-gate, nothing measured: k8v4, rotated where the model allows it).",
)
@click.option(
    "--quantized-kv-start",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Context at which KV quantization begins.",
)
@click.option(
    "--quality-gate/--no-quality-gate",
    default=True,
    show_default=True,
    help="Measure the bundle's perplexity against the source on kinds of text calibration never reads (kvrig's "
    "prose, passages of Python modules and of the Debian Reference; seconds to minutes for small models) and refuse "
    "it over --max-ppl-increase on any of them unless --ignore-gate.",
)
@click.option(
    "--gate-text",
    "gate_texts",
    multiple=True,
    metavar="FILE",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A text file of your own (UTF-8 or .gz; repeatable) the gate reads too, as a kind of its own: the kind of "
    "text your app will read. --weights auto, --kv auto and --fit choose on it as well.",
)
@click.option(
    "--cache/--no-cache",
    default=True,
    show_default=True,
    help="Reuse the source's perplexities measured by an earlier package of the same model (kept in "
    "$KVRIG_CACHE_DIR, else ~/.cache/kvrig or ~/Library/Caches/kvrig); --no-cache measures again and keeps nothing.",
)
@click.option(
    "--max-ppl-increase",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0),
    callback=not_nan("a percentage"),
    help="Gate limit in percent.",
)
@click.option(
    "--page-tokens", default=256, show_default=True, type=click.IntRange(min=1), help="Eviction granularity in tokens."
)
@click.option(
    "--keep-tokens",
    default=4,
    show_default=True,
    type=click.IntRange(min=0),
    help="Tokens kept at the start when evicting.",
)
@click.option("--prefill-step", default=512, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--max-context", type=click.IntRange(min=1), help="Without --device: the context written to kvcache.json."
)
@click.option("--replace", is_flag=True, help="Replace an existing bundle at -o (swapped in at once).")
@click.option("--ignore-fit", is_flag=True, help="Package even if the plan says it does not fit on --device.")
@click.option("--ignore-gate", is_flag=True, help="Keep a bundle over the quality gate (recorded as forced).")
@retired_force_option(
    "it is split into --replace (an existing bundle at -o), --ignore-fit (the plan's fit check) and "
    "--ignore-gate (the quality gate); give the ones you mean"
)
@click.option(
    "-o", "--output", "--out", "output", required=True, type=click.Path(path_type=Path), help="Bundle folder to create."
)
@json_option
def package(
    model: Path | None,
    device: str | None,
    ram_gb: int | None,
    weights: str,
    group_size: int,
    weights_layout: str,
    fit: int | None,
    kv: str,
    quantized_kv_start: int,
    quality_gate: bool,
    gate_texts: tuple[Path, ...],
    cache: bool,
    max_ppl_increase: float,
    page_tokens: int,
    keep_tokens: int,
    prefill_step: int,
    max_context: int | None,
    replace: bool,
    ignore_fit: bool,
    ignore_gate: bool,
    output: Path,
    as_json: bool,
) -> None:
    """Quantize MODEL (Hugging Face directory or GGUF file; default: the embedded SmolLM2-135M-Instruct)
    into a bundle: MLX weights, tokenizer, config.json, kvcache.json, manifest.json."""
    from kvrig.runtime.blas import ensure_openblas

    ensure_openblas()
    from kvrig.bundle.options import PackageOptions
    from kvrig.packaging import package as package_bundle
    from kvrig.profiles import device_ref
    from kvrig.quality.bench import Tally

    if ram_gb is not None and device is None:
        raise click.BadParameter("--ram names the RAM of --device; give the device too", param_hint="--ram")
    device = device_ref(device, ram_gb) if device is not None else None

    options = PackageOptions(
        weights=weights,
        group_size=group_size,
        weights_layout=weights_layout,  # type: ignore[arg-type]
        kv=kv,
        fit=fit,
        device=device,
        replace=replace,
        ignore_fit=ignore_fit,
        ignore_gate=ignore_gate,
        quantized_kv_start=quantized_kv_start,
        quality_gate=quality_gate,
        gate_texts=tuple(map(str, gate_texts)),
        cache=cache,
        max_ppl_increase_pct=max_ppl_increase,
        page_tokens=page_tokens,
        keep_tokens=keep_tokens,
        prefill_step_size=prefill_step,
        max_context=max_context,
        # A count of layers quantized every few seconds, not a line each (-v: each layer's line)
        progress=(tally := Tally(info, every_s=0 if OUTPUT.verbosity > 0 else 10.0)),
    )
    try:
        result = package_bundle(model, output, options)
    finally:
        tally.close()
    for warning in result.warnings:
        warn(warning)
    if as_json:
        echo_json({"path": str(result.path), "manifest": result.manifest, "kvcache": result.kvcache})
        return
    m = result.manifest
    total = sum(f.size for f in m.files)
    click.echo(f"wrote {result.path} ({len(m.files)} files, {human_bytes(total)})")
    click.echo(f"  source   {m.source.kind} {m.source.name} ({m.source.architecture})")
    click.echo(f"  weights  {m.recipe.weights}, group size {m.recipe.group_size}")
    click.echo(
        f"  kv       {m.recipe.kv or m.recipe.kv_scheme}, group size {m.recipe.kv_group_size}, "
        f"max context {result.kvcache.max_context}"
    )
    if m.quality is not None:
        q = m.quality
        verdict = "passed" if q.passed else "FAILED (packaged anyway: --ignore-gate)"
        per_kind = ", ".join(f"{k.kind} {k.ppl_delta_pct:+.1f} %" for k in q.kinds)
        click.echo(
            f"  quality  perplexity vs the unquantized source: {per_kind or f'{q.ppl_delta_pct:+.1f} %'} (limit "
            f"{q.max_increase_pct:g} % on every text): {verdict}"
        )
    if m.choice is not None:
        _print_choice(m.choice)
    if m.prediction is not None:
        p = m.prediction
        click.echo(
            f"  plan     {p.device}: weights {human_bytes(p.weights_bytes)}, "
            f"{human_bytes(p.kv_bytes_per_token)}/token KV, limit {human_bytes(p.limit_bytes)}"
        )


def _print_choice(choice: object) -> None:
    from kvrig.schemas.bundle import Choice

    assert isinstance(choice, Choice)
    for title, rows, why in (
        ("KV specs measured (--kv auto)", choice.kv, choice.kv_why),
        ("weight recipes tried (--weights auto)", choice.weights, choice.weights_why),
        (f"weights x KV pairs for {choice.fit_context} tokens (--fit)", choice.fit, choice.fit_why),
    ):
        if not rows:
            continue
        click.echo(f"  {title}:")
        click.echo(f"    {'weights':10}{'kv':18}{'weights':>11}{'KV@4096':>10}{'max ctx':>9}{'PPL':>9}  verdict")
        for c in rows:
            w = human_bytes(c.weights_bytes) if c.weights_bytes else "-"
            k = human_bytes(c.kv_bytes) if c.kv_bytes else "-"
            ctx = str(c.max_context) if c.max_context is not None else "-"
            ppl = f"{c.ppl_delta_pct:+.2f}%" if c.ppl_delta_pct is not None else "-"
            said = ("unavailable", "failed gate", "over the limit")
            reason = f" ({c.reason})" if c.reason and c.verdict in said else ""
            click.echo(f"    {c.weights:10}{c.kv:18}{w:>11}{k:>10}{ctx:>9}{ppl:>9}  {c.verdict}{reason}")
        click.echo(f"    why: {why}")
