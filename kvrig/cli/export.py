"""`kvrig export`: write a bundle for another runtime (Core ML)."""

from __future__ import annotations

from pathlib import Path

import click

from kvrig.cli.options import retired_force_option
from kvrig.cli.render import echo_json, human_bytes, json_option


@click.group("export", short_help="Write a bundle for another runtime: a stateful Core ML program (coreml).")
def export() -> None:
    """Write a bundle for another runtime."""


@export.command("coreml")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--output",
    "-o",
    "--out",
    "output",
    required=True,
    type=click.Path(path_type=Path),
    help="Model.mlpackage to write.",
)
@click.option("--target", default="iOS18", show_default=True, help="Minimum deployment target (iOS18 or iOS26).")
@click.option(
    "--context",
    type=click.IntRange(min=1),
    help="Tokens the KV state holds (default: the bundle's planned max context from kvcache.json).",
)
@click.option("--replace", is_flag=True, help="Replace an existing OUTPUT.")
@retired_force_option("use --replace to replace an existing OUTPUT")
@json_option
def coreml(bundle: Path, output: Path, target: str, context: int | None, replace: bool, as_json: bool) -> None:
    """Write BUNDLE as a stateful Core ML program: its own 4/8-bit weight groups as block-wise constexpr ops,
    the KV cache as iOS 18 state, one function for prefill (many tokens) and decode (one)."""
    from kvrig.coreml.export import export_coreml

    result = export_coreml(bundle, output, target=target, context=context, replace=replace)
    if as_json:
        echo_json(result)
        return
    pkg, plan = result.package, result.plan
    click.echo(f"{output}: {result.model_type}, target {target}, context {result.context} ({result.context_source})")
    for f in pkg.inputs:
        click.echo(f"  input  {f.name} {f.dtype} {f.shape}" + (f" range {f.range}" if f.range else ""))
    for f in pkg.outputs:
        click.echo(f"  output {f.name} {f.dtype} {f.shape}")
    first = pkg.states[0]
    state = human_bytes(plan.state_bytes[result.context])
    click.echo(f"  states {len(pkg.states)} × {first.dtype} {first.shape} = {state}")
    dtypes = ", ".join(f"{k} {human_bytes(v)}" for k, v in pkg.weight_blob_dtypes.items())
    click.echo(
        f"  weights {human_bytes(pkg.weight_blob_bytes)} ({dtypes}) in {pkg.weight_blobs} constants; "
        f"weight.bin {pkg.weight_file_bytes:,} bytes = plan"
    )


def show_coreml_plan(
    model: Path | None, device: str, weights: str, group_size: int, contexts: list[int], limit: str, as_json: bool
) -> None:
    """`kvrig plan --backend coreml` (the option lives in cli/plan.py; this renders it)."""
    from kvrig.planner.coreml import plan_coreml_model

    p = plan_coreml_model(
        model,
        device,
        weights=weights,
        group_size=group_size,
        contexts=contexts,
        limit=limit,  # type: ignore[arg-type]
    )
    if as_json:
        echo_json(p)
        return
    quantized = f"{p.bits}-bit" if p.bits else "fp16"
    own = f", {p.own_layers} layers with their own bits or group size" if p.own_layers else ""
    click.echo(
        f"Core ML program for {p.model} ({p.model_type}), {quantized} g{p.group_size}{own}, on {p.device} "
        f"({p.limit_kind} app limit {human_bytes(p.limit_bytes or 0)})"
    )
    dtypes = ", ".join(f"{k} {human_bytes(v)}" for k, v in p.weights_by_dtype.items())
    click.echo(f"  weights   {p.weights_bytes:,} bytes ({dtypes}); weight.bin {p.weight_file_bytes:,} bytes")
    click.echo(f"  KV state  {p.state_bytes_per_token:,} bytes/token (fp16 keys and values, every layer)")
    for c in contexts:
        share = f" = {p.total_bytes[c] / p.limit_bytes:.0%} of the limit" if p.limit_bytes else ""
        total = human_bytes(p.total_bytes[c])
        click.echo(f"  @{c:<7} state {human_bytes(p.state_bytes[c])}, weights + state {total}{share}")
