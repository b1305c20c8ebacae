"""`kvrig bench`: benchmarks as commands (ratios measured side by side in one run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kvrig.cli.options import InputPath, checked_specs, int_list, seconds_option
from kvrig.cli.output import info
from kvrig.cli.plan import plan_bench
from kvrig.cli.render import echo_json, human_bytes, json_option

F = TypeVar("F", bound=Callable[..., Any])


_kinds_option = click.option(
    "--kinds",
    default="legal,quotes",
    show_default=True,
    help="Kinds of text to evaluate on (texts.py): legal and quotes are kinds calibration never reads; "
    "python-held-out and manual are files it never reads; a path is a text file of your own (UTF-8 or .gz), "
    "a kind of its own.",
)


def _count_option(flag: str, default: int, help: str) -> Callable[[F], F]:
    """A passage count or length: at least 1 (0 is click's usage error naming the option, not a traceback)."""
    return click.option(flag, default=default, show_default=True, type=click.IntRange(min=1), help=help)


@click.group(
    "bench",
    short_help="Benchmarks: quality of recipes x KV schemes, quantizers vs mlx-lm's, host runtime vs mlx-lm, the "
    "planner's own cost, startup.",
)
def bench() -> None:
    """Benchmarks."""


@bench.command("runtime")
@click.argument("bundle", type=click.Path(path_type=Path))  # not a bundle: BundleError (7), as everywhere
@click.option("--prompt-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--decode-tokens", default=16, show_default=True, type=click.IntRange(min=1))
@seconds_option("--timeout", 3600.0, "Seconds per side.", minimum=1)
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
    from kvrig.runtime.bench import compare

    result = compare(bundle, prompt_tokens, decode_tokens, timeout=timeout, reference=reference)
    ours, plain, ratios = result.ours, result.plain, result.ratios
    rows = [ours, plain] + ([result.reference] if result.reference is not None else [])
    if as_json:
        out = {"bundle": str(bundle), "ours": vars(ours), "plain": vars(plain), "ratios": ratios}
        if result.reference is not None:
            out["reference_f32"] = vars(result.reference)
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


def _csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


@bench.command("quality")
@click.argument("model", required=False, type=InputPath(path_type=Path, exists=True))
@click.option(
    "--recipes",
    default="q4,q4g32,q8,mixed_4_6,gptq-q4,dq-4.6,imx-4.6,gpx-q4,gpx-4.6",
    show_default=True,
    callback=checked_specs("weights", auto=False, several=True, empty_ok=True),
    help="Weight recipes: qN[gG], awq-qN, gptq-qN, imx-qN, gpx-qN, dq-BPW, imx-BPW, gpx-BPW, mixed_X_Y; each "
    "quantized one optionally +kd[N] (distilled).",
)
@click.option(
    "--kv",
    "kv_variants",
    default=None,
    callback=checked_specs("kv", auto=False, several=True, empty_ok=True),
    help="KV variants, e.g. k8v4,k8v4+rot,k4v4+rot+s4+w64 "
    "(rot: Hadamard on K and V, rotk: keys only, sN: sink tokens, wN: recent window).",
)
@_kinds_option
@_count_option("--weights-tokens", 512, "Tokens per passage for the weight rows.")
@_count_option(
    "--weights-passages",
    4,
    "Passages per kind for the weight rows, spread over the kind's files; one perplexity over all of them.",
)
@_count_option("--kv-tokens", 2048, "Tokens per passage for the KV rows (each passage one run from empty caches).")
@_count_option(
    "--kv-passages", 4, "Passages per kind for the KV rows, spread over the kind's files as --weights-passages are."
)
@click.option(
    "--contexts",
    default="512,1024,2048,4096",
    show_default=True,
    callback=int_list,
    help="Contexts for bytes and decode.",
)
@click.option(
    "--decode-steps",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="Decode steps timed per scheme at each context (fp16 and k8v4 interleaved for the goal's ratio).",
)
@click.option(
    "--kv-reads",
    type=click.Choice(["decoded", "chunked"]),
    default="decoded",
    show_default=True,
    help="How the KV rows' perplexity reads a recent window: decoded (each position its own latest tokens in "
    "float, as generating that token reads them) or chunked (the window at each 256-token chunk's end, as a "
    "prefill chunk reads it).",
)
@click.option(
    "--factual-recipe",
    default="q8",
    show_default=True,
    callback=checked_specs("weights", auto=False, several=False, empty_ok=True),
    help="Recipe checked on factual prompts, with k8v4 KV rotated where the head dims allow (--kv auto's rule "
    "when nothing is measured); '' skips.",
)
@click.option(
    "-o",
    "--output",
    "--out",
    "output",
    type=click.Path(path_type=Path),
    default=Path("build/quality"),
    show_default=True,
    help="Folder for quality.json and the plots.",
)
@json_option
def quality(
    model: Path | None,
    recipes: list[str],
    kv_variants: list[str] | None,
    kinds: str,
    weights_tokens: int,
    weights_passages: int,
    kv_tokens: int,
    kv_passages: int,
    contexts: list[int],
    decode_steps: int,
    kv_reads: str,
    factual_recipe: str,
    output: Path,
    as_json: bool,
) -> None:
    """Perplexity of weight recipes and KV specs against the unquantized source on kinds of text the calibration
    never reads (licences, quotations and dialogue; Debian packages), KV bytes measured vs planned, host decode
    tok/s by context, plots.

    MODEL: a bundle (its manifest names the source; its own weights get a row), a model folder or GGUF; none:
    the embedded SmolLM2. Minutes on a 2-core CPU; not part of the test suite."""
    from kvrig.fileio import check_folder_possible
    from kvrig.runtime.blas import ensure_openblas

    check_folder_possible(output)  # before minutes of measuring: an -o that cannot be a folder is refused now
    ensure_openblas()
    from kvrig.quality.bench import DEFAULT_KV, run_quality_bench, write_plots

    report = run_quality_bench(
        model,
        recipes=tuple(recipes),
        kv_variants=DEFAULT_KV if kv_variants is None else tuple(kv_variants),  # '' runs no KV rows
        kinds=_csv(kinds),
        weights_tokens=weights_tokens,
        weights_passages=weights_passages,
        kv_tokens=kv_tokens,
        kv_passages=kv_passages,
        contexts=tuple(contexts),
        decode_steps=decode_steps,
        kv_reads=kv_reads,
        factual_recipe=factual_recipe or None,
        progress=info,
    )
    paths = write_plots(report, output)
    if as_json:
        echo_json(report.to_json())
        return
    _print_quality(report, paths)


def _spread(row: Any) -> str:
    """What a bench row's perplexity is over."""
    return f"{row.passages} passages of {row.tokens} tokens spread over each kind"


def _kind_cells(change: dict[str, float], width: dict[str, int]) -> str:
    """One row's PPL change per kind, in the columns `width` gives (in its order); '-' where none was measured."""
    return "".join(f"{change[k]:+{w - 1}.2f}%" if k in change else f"{'-':>{w}}" for k, w in width.items())


def _print_quality(report: object, paths: list[Path]) -> None:
    from kvrig.quality.bench import QualityReport, worst_by_name
    from kvrig.texts import column_label

    assert isinstance(report, QualityReport)
    kinds = list(report.text)
    click.echo(f"model {report.model}; evaluated on kinds never calibrated on: {', '.join(kinds)}")
    for kind, files in report.text.items():
        click.echo(f"  {kind}: {', '.join(files)}")
    if report.calibration:
        click.echo(f"calibrated on: {', '.join(report.calibration)}")
    click.echo(
        "source PPL (unquantized weights and KV): "
        + ", ".join(f"{v:.3f} on {k} tokens" for k, v in report.source_ppl.items())
    )
    if report.weights:
        spread = _spread(report.weights[0])
        click.echo(f"\nweight recipes ({spread}, fp KV): PPL change")
        width = {k: max(11, len(column_label(k)) + 2) for k in kinds}
        kind_heads = "".join(f"{column_label(k):>{width[k]}}" for k in kinds)
        click.echo(f"{'recipe':16}{'bits/weight':>12}{kind_heads}{'worst':>9}{'seconds':>9}")
        worst = worst_by_name(report.weights, lambda r: r.recipe)
        for name, w in worst.items():
            by_kind = {r.kind: r for r in report.weights if r.recipe == name}
            bpw = f"{w.bits_per_weight:.3f}" if w.bits_per_weight is not None else "-"
            cells = _kind_cells({k: r.ppl_delta_pct for k, r in by_kind.items()}, width)
            click.echo(f"{name:16}{bpw:>12}{cells}{w.ppl_delta_pct:+8.2f}%{w.seconds:9.0f}")
    if report.kv:
        ctx = sorted(report.kv[0].decode_tps)
        last = ctx[-1]
        reads = {
            "decoded": "each position reads its own recent window, as decoding it would",
            "chunked": "the recent window at each 256-token chunk's end",
        }[report.kv_reads]
        spread = _spread(report.kv[0])
        click.echo(f"\nKV specs (source weights, {spread}, {reads}): PPL change")
        worst = worst_by_name(report.kv, lambda r: r.kv)
        fp = worst.get("fp16")
        width = {k: max(10, len(column_label(k)) + 2) for k in kinds}
        head = f"{'kv':20}" + "".join(f"{column_label(k):>{width[k]}}" for k in kinds)
        head += f"{'worst':>9}{'phone plan':>12}{'of fp16':>8}"
        click.echo(head + "".join(f"{'tok/s@' + str(c):>12}" for c in ctx))
        for name, w in worst.items():
            by_kind = {r.kind: r for r in report.kv if r.kv == name}
            frac = w.phone_kv_bytes[last] / fp.phone_kv_bytes[last] if fp else 0.0
            cells = _kind_cells({k: r.ppl_delta_pct for k, r in by_kind.items()}, width)
            click.echo(
                f"{name:20}{cells}{w.ppl_delta_pct:+8.2f}%{human_bytes(w.phone_kv_bytes[last]):>12}{frac:8.1%}"
                + "".join(f"{w.decode_tps[c]:12.2f}" for c in ctx)
            )
            if w.kv_scheme and "@top" in name:
                click.echo(f"  {name}: layers chosen by measurement: {w.kv_scheme}")
        exact = all(r.kv_bytes == r.predicted_kv_bytes for r in report.kv)
        click.echo(f"measured cache bytes (host) equal the plan at every context: {'yes' if exact else 'NO'}")
    if report.factual:
        click.echo(f"\nfactual prompts, source vs {report.factual_recipe}")
        for c in report.factual:
            click.echo(f"  {c.prompt}\n    source: {c.source_answer!r}\n    {report.factual_recipe}: {c.answer!r}")
    click.echo("\ngoals")
    for g in report.goals:
        best = g["best"] if g["best"] is not None else "nothing this run measured qualifies"
        click.echo(f"  [{'met' if g['met'] else 'MISSED'}] {g['goal']}: {best}")
    click.echo("\nwrote " + ", ".join(str(p) for p in paths))


@bench.command("quantize")
@click.argument("model", required=False, type=InputPath(path_type=Path, exists=True))
@click.option(
    "--recipes",
    default="imx-q4,imx-4.6,gpx-q4,gpx-4.6,gptq-q4,awq-q4,dwq-q4",
    show_default=True,
    callback=checked_specs("weights", auto=False, several=True, beside="dwq-"),
    help="Weight recipes (as kvrig package takes them) and dwq-qN (mlx-lm's DWQ from the qN layout).",
)
@_count_option("--tokens", 512, "Tokens per evaluation passage.")
@_count_option(
    "--passages", 4, "Evaluation passages per kind, spread over its files (as bench quality's --weights-passages)."
)
@_kinds_option
@seconds_option("--timeout", 600.0, "Seconds a recipe may take; longer: stopped and skipped.", minimum=0.01)
@click.option("--scaling/--no-scaling", default=True, show_default=True, help="Time kvrig's on two tiny models.")
@json_option
def quantize(
    model: Path | None,
    recipes: list[str],
    tokens: int,
    passages: int,
    kinds: str,
    timeout: float,
    scaling: bool,
    as_json: bool,
) -> None:
    """Wall time, bits per weight and perplexity of each recipe on MODEL (default: the embedded SmolLM2),
    kvrig's beside mlx-lm's GPTQ, AWQ and DWQ, each in its own process; calibrated as kvrig package calibrates,
    measured on each kind of text calibration never reads. Minutes on a 2-core CPU; not part of the test suite."""
    from kvrig.runtime.blas import ensure_openblas

    ensure_openblas()
    from kvrig.quality.quantize_bench import run_quantize_bench

    report = run_quantize_bench(
        model,
        recipes=tuple(recipes),  # already read by the option's callback
        tokens=tokens,
        passages=passages,
        kinds=_csv(kinds),
        timeout=timeout,
        scaling=scaling,
        progress=lambda line: click.echo(line, err=True),
    )
    if as_json:
        echo_json(report.to_json())
        return
    for line in report.lines():
        click.echo(line)


# `kvrig bench plan` lives beside the plan command it measures.
bench.add_command(plan_bench, "plan")


@bench.command("startup")
@click.option("--runs", default=5, show_default=True, type=click.IntRange(1), help="Runs of each command.")
@json_option
def startup(runs: int, as_json: bool) -> None:
    """`kvrig --help` beside `pymobiledevice3 --help` and an empty Python, each a fresh interpreter, interleaved
    in one run: the cost of starting kvrig, as a ratio to the tool a device user already runs."""
    from kvrig.startup import time_startup

    times = {t.command: t for t in time_startup(runs)}
    ours, peer = times["kvrig --help"], times["pymobiledevice3 --help"]
    ratio = ours.median_s / peer.median_s
    if as_json:
        echo_json(
            {
                "runs": runs,
                "commands": {
                    name: {"median_s": t.median_s, "best_s": t.best_s, "runs_s": t.runs} for name, t in times.items()
                },
                "ratio_kvrig_to_pymobiledevice3": ratio,
            }
        )
        return
    for name, t in times.items():
        click.echo(f"{name:<24} median {t.median_s:.3f} s   best {t.best_s:.3f} s")
    click.echo(f"kvrig --help takes {ratio:.2f}x the time of pymobiledevice3 --help (median of {runs})")
