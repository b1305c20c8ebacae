"""`kvrig run`: generate text on the host with a bundle's KV configuration."""

from __future__ import annotations

from pathlib import Path

import click

from kvrig.cli.options import finite
from kvrig.cli.render import echo_json, human_bytes, json_option


def _not_empty(prompt: str) -> str:
    if not prompt:
        raise click.BadParameter("expected some text to continue")
    return prompt


@click.command("run", short_help="Generate on the host with a bundle's KV configuration; print tok/s and peak memory.")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--prompt",
    "-p",
    required=True,
    callback=lambda ctx, param, value: _not_empty(value),
    help="Prompt text (wrapped in the chat template unless --raw).",
)
@click.option("--max-tokens", "-n", default=128, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    callback=finite("a temperature of 0 or more"),
    help="0 = greedy.",
)
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@json_option
def run(bundle: Path, prompt: str, max_tokens: int, temperature: float, raw: bool, as_json: bool) -> None:
    """Generate from BUNDLE on this machine, streaming tokens; print prefill/decode tok/s and peak memory."""
    from kvrig.runtime.blas import ensure_openblas, openblas_loaded

    ensure_openblas()
    from kvrig.bundle.manifest import load_manifest
    from kvrig.runtime.generate import load_bundle, run_bundle

    load_manifest(bundle)  # a clear error for a folder that is not a bundle
    loaded = load_bundle(bundle)

    def stream(text: str) -> None:
        click.echo(text, nl=False)

    stats = run_bundle(
        loaded,
        prompt,
        max_tokens=max_tokens,
        chat=not raw,
        temperature=temperature,
        on_text=None if as_json else stream,
    )
    if as_json:
        echo_json(
            {
                "text": stats.text,
                "tokens": stats.tokens,
                "prompt_tokens": stats.prompt_tokens,
                "generated_tokens": stats.generated_tokens,
                "prefill_tps": stats.prefill_tps,
                "decode_tps": stats.decode_tps,
                "peak_memory_bytes": stats.peak_memory_bytes,
                "finish_reason": stats.finish_reason,
                "kv_scheme": loaded.kvcache.scheme,
                "kv": loaded.kvcache.spec,  # the scheme with its extras (rotation, sinks, window)
                "openblas": openblas_loaded(),
            }
        )
        return
    click.echo()
    click.echo(
        f"-- {stats.prompt_tokens} prompt tokens at {stats.prefill_tps:.1f} tok/s, "
        f"{stats.generated_tokens} generated at {stats.decode_tps:.1f} tok/s, "
        f"peak memory {human_bytes(stats.peak_memory_bytes)} (kv {loaded.kvcache.spec})",
        err=True,
    )
