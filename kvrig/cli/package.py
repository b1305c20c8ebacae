"""`kvrig package`: quantize a model into a bundle ready to push to the phone."""

from __future__ import annotations

from pathlib import Path

import click

from kvrig.cli.render import echo_json, human_bytes, json_option


@click.command("package", short_help="Quantize a model into a bundle for the phone (weights, kvcache.json, manifest).")
@click.argument("model", required=False, type=click.Path(path_type=Path))
@click.option("--device", "-d", help="Device profile to plan for (refuses a bundle that does not fit).")
@click.option(
    "--weights",
    default="q8",
    show_default=True,
    help="q2-q8, mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6, fp16. The default is q8: on SmolLM2 q4 (group 64 or "
    "32) and q5 raise perplexity 12-35 %, and q6 answers 'capital of France' wrong (see `kvrig bench quality`).",
)
@click.option("--group-size", default=64, show_default=True, type=int, help="Weight quantization group size.")
@click.option(
    "--kv",
    default="auto",
    show_default=True,
    help="KV spec: fp16, kXvY[gZ] (k8v4, k6v4g32) with +kN@L1.L2 / +kN@topM (keys of some layers at N bits), "
    "+rot / +rotk (Hadamard rotation of keys and values / keys), +sN (sink tokens), +wN (recent window). auto: "
    "k8v4, rotated where the model allows it.",
)
@click.option(
    "--quantized-kv-start",
    default=0,
    show_default=True,
    type=int,
    help="Context at which KV quantization begins.",
)
@click.option(
    "--quality-gate/--no-quality-gate",
    default=True,
    show_default=True,
    help="Measure the bundle's perplexity against the source on a short built-in text (seconds for small "
    "models; skip for huge ones) and refuse it over --max-ppl-increase unless --force.",
)
@click.option("--max-ppl-increase", default=10.0, show_default=True, type=float, help="Gate limit in percent.")
@click.option("--page-tokens", default=256, show_default=True, type=int, help="Eviction granularity in tokens.")
@click.option("--keep-tokens", default=4, show_default=True, type=int, help="Tokens kept at the start when evicting.")
@click.option("--prefill-step", default=512, show_default=True, type=int)
@click.option("--max-context", type=int, help="Without --device: the context written to kvcache.json.")
@click.option(
    "--force",
    is_flag=True,
    help="Package even if the plan says it does not fit; replace an existing bundle at -o (swapped in at once).",
)
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Bundle folder to create.")
@json_option
def package(
    model: Path | None,
    device: str | None,
    weights: str,
    group_size: int,
    kv: str,
    quantized_kv_start: int,
    quality_gate: bool,
    max_ppl_increase: float,
    page_tokens: int,
    keep_tokens: int,
    prefill_step: int,
    max_context: int | None,
    force: bool,
    output: Path,
    as_json: bool,
) -> None:
    """Quantize MODEL (Hugging Face directory or GGUF file; default: the embedded SmolLM2-135M-Instruct)
    into a bundle: MLX weights, tokenizer, config.json, kvcache.json, manifest.json."""
    from kvrig.runtime.blas import ensure_openblas

    ensure_openblas()
    from kvrig.bundle.options import PackageOptions
    from kvrig.packaging import package as package_bundle

    options = PackageOptions(
        weights=weights,
        group_size=group_size,
        kv=kv,
        device=device,
        force=force,
        quantized_kv_start=quantized_kv_start,
        quality_gate=quality_gate,
        max_ppl_increase_pct=max_ppl_increase,
        page_tokens=page_tokens,
        keep_tokens=keep_tokens,
        prefill_step_size=prefill_step,
        max_context=max_context,
    )
    result = package_bundle(model, output, options)
    for warning in result.warnings:
        click.echo(f"kvrig: warning: {warning}", err=True)
    if as_json:
        echo_json({"path": str(result.path), "manifest": result.manifest, "kvcache": result.kvcache})
        return
    m = result.manifest
    total = sum(f.size for f in m.files)
    click.echo(f"wrote {result.path} ({len(m.files)} files, {human_bytes(total)})")
    click.echo(f"  source   {m.source.kind} {m.source.name} ({m.source.architecture})")
    click.echo(f"  weights  {m.recipe.weights}, group size {m.recipe.group_size}")
    click.echo(
        f"  kv       {m.recipe.kv_scheme}, group size {m.recipe.kv_group_size}, "
        f"max context {result.kvcache.max_context}"
    )
    if m.quality is not None:
        q = m.quality
        verdict = "passed" if q.passed else "FAILED (packaged anyway: --force)"
        click.echo(
            f"  quality  perplexity {q.bundle_ppl:.2f} vs source {q.source_ppl:.2f} ({q.ppl_delta_pct:+.1f} %, limit "
            f"{q.max_increase_pct:g} %) on {q.tokens} tokens of the built-in text: {verdict}"
        )
    if m.prediction is not None:
        p = m.prediction
        click.echo(
            f"  plan     {p.device}: weights {human_bytes(p.weights_bytes)}, "
            f"{human_bytes(p.kv_bytes_per_token)}/token KV, limit {human_bytes(p.limit_bytes)}"
        )
