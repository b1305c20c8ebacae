"""`kvrig bench`: benchmarks as commands (ratios measured side by side in one run)."""

from __future__ import annotations

from pathlib import Path

import click

from toolchain.cli.render import echo_json, human_bytes, json_option


@click.group("bench", short_help="Benchmarks (runtime: our host runtime vs plain mlx-lm on one bundle).")
def bench() -> None:
    """Benchmarks."""


@bench.command("runtime")
@click.argument("bundle", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--prompt-tokens", default=64, show_default=True, type=int)
@click.option("--decode-tokens", default=16, show_default=True, type=int)
@click.option("--timeout", default=3600.0, show_default=True, type=float, help="Seconds per side.")
@click.option(
    "--reference/--no-reference",
    default=True,
    show_default=True,
    help="Also run mlx-lm with the model cast to float32 and OpenBLAS preloaded (a reference row).",
)
@json_option
def runtime(
    bundle: Path, prompt_tokens: int, decode_tokens: int, timeout: float, reference: bool, as_json: bool
) -> None:
    """Our host runtime vs plain mlx-lm generate on BUNDLE: prefill tok/s, decode tok/s, peak memory.

    Plain mlx-lm runs the bundle as installed (float16, MLX's bundled BLAS); it is slow on a CPU, so keep the
    prompt short. Ratios are ours / plain; the reference row shows how much of the gap float32 alone closes."""
    from toolchain.bundle import load_manifest
    from toolchain.runtime.bench import run_side

    load_manifest(bundle)
    ours = run_side("ours", bundle, prompt_tokens, decode_tokens, timeout=timeout)
    plain = run_side("plain", bundle, prompt_tokens, decode_tokens, timeout=timeout)
    rows = [ours, plain]
    if reference:
        rows.append(run_side("plain-f32", bundle, prompt_tokens, decode_tokens, timeout=timeout))
    ratios = {
        "prefill": ours.prefill_tps / plain.prefill_tps if plain.prefill_tps else float("inf"),
        "decode": ours.decode_tps / plain.decode_tps if plain.decode_tps else float("inf"),
        "peak_memory": ours.peak_memory_bytes / plain.peak_memory_bytes if plain.peak_memory_bytes else 0.0,
    }
    if as_json:
        out = {"bundle": str(bundle), "ours": vars(ours), "plain": vars(plain), "ratios": ratios}
        if reference:
            out["reference_f32"] = vars(rows[2])
        echo_json(out)
        return
    click.echo(f"bundle {bundle}: {ours.prompt_tokens} prompt tokens, {ours.generated_tokens} generated")
    click.echo(f"{'':14}{'prefill tok/s':>15}{'decode tok/s':>15}{'peak memory':>14}  kv     openblas")
    for r in rows:
        click.echo(
            f"{r.side:14}{r.prefill_tps:15.2f}{r.decode_tps:15.2f}{human_bytes(r.peak_memory_bytes):>14}  "
            f"{r.kv:6} {'yes' if r.openblas else 'no'}"
        )
    click.echo(f"{'ours / plain':14}{ratios['prefill']:14.1f}x{ratios['decode']:14.1f}x{ratios['peak_memory']:13.2f}x")
