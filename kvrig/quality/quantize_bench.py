"""`kvrig bench quantize`: how long each weight recipe takes to quantize a model and what it costs in perplexity,
kvrig's own (imx, gpx) beside mlx-lm's (GPTQ, AWQ, DWQ: `mlx_lm.quant`) in one run, plus a scaling check of
kvrig's quantizers on two tiny models.

Every recipe runs in a child process of its own (`python -m kvrig.quality.quantize_bench`, the job on stdin,
the result as one JSON line on stdout), so the times are not shared with another recipe's caches and one that
runs out of time, memory or support is named as skipped, with why, while the others still run. Its per-layer
progress goes to stderr. The time is the quantization's alone (calibration included; loading the model and
measuring it are not).

Calibration is what `kvrig package` calibrates on (`quantize.recipes.calibration_tokens`: the calibration kinds
of kvrig/texts.py); evaluation is each kind of text calibration never reads (`texts.EVALUATION_KINDS`, as `kvrig
bench quality` judges), perplexity per kind over passages spread over it, the quality bench's weight rows' passages.
Nothing downloads."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvrig.exceptions import KvrigError, ModelConfigError
from kvrig.models import load_model_spec
from kvrig.models.gguf import embedded_default_model
from kvrig.models.source import read_tokenizer
from kvrig.quality.bench import bench_source, load_weights, passages_ppl
from kvrig.quantize.recipes import calibration_files
from kvrig.recipes import parse_weights
from kvrig.runtime.blas import preload_env
from kvrig.texts import EVALUATION_KINDS, column_label, evaluation_kind, kind_segments, read_kind

DEFAULT_RECIPES = ("imx-q4", "imx-4.6", "gpx-q4", "gpx-4.6", "gptq-q4", "awq-q4", "dwq-q4")
DEFAULT_TIMEOUT = 600.0
"""Seconds a recipe's quantization may take before it is stopped and named as skipped."""
DWQ_DEFAULT_STEPS = 2048 // 4
"""Steps of mlx-lm's DWQ command at its defaults (2048 samples, batch 4; 1025-token rows, 4x ours)."""
SCALING_HIDDEN = (256, 512)
"""Hidden sizes of the two tiny models of the scaling check (intermediate 3x, 4 layers, 4096-token vocabulary)."""
SCALING_RECIPES = ("imx-q4", "gpx-q4")
SCALING_VOCAB = 4096
GOAL_SECONDS = 20.0
"""The goal for kvrig's own recipes (imx, gpx) on the embedded SmolLM2: quantized within this many seconds, wall
time, calibration included."""


@dataclass
class RecipeRun:
    recipe: str
    by: str
    """kvrig (imx, gpx) or mlx-lm (round-to-nearest, gptq, awq, dq, dwq); - for an unquantized recipe."""
    seconds: float | None = None
    """Wall time of the quantization, calibration included (loading and evaluation not)."""
    cpu_seconds: float | None = None
    bits_per_weight: float | None = None
    """As mlx-lm's compute_bits_per_weight counts them."""
    ppl: dict[str, float] | None = None
    """Perplexity by evaluation kind."""
    ppl_delta_pct: dict[str, float] | None = None
    layers: int = 0
    """Quantized layers of the result."""
    peak_rss_bytes: int | None = None
    note: str = ""
    skipped: str | None = None
    """Why the recipe has no result (it did not finish within its timeout, cannot apply here, ...)."""


@dataclass
class ScalingPoint:
    hidden: int
    params: int
    seconds: dict[str, float]


@dataclass
class QuantizeReport:
    model: str
    calibration: dict[str, list[str]]
    """Calibration kind -> the files read."""
    evaluation: dict[str, list[str]]
    """Evaluation kind (never calibrated on) -> the files read."""
    tokens: int
    """Tokens per evaluation passage."""
    source_ppl: dict[str, float]
    timeout_seconds: float
    runs: list[RecipeRun]
    scaling: list[ScalingPoint] = field(default_factory=list)
    cpus: int = 0
    load_average: list[float] = field(default_factory=list)
    """The machine's 1-minute load average at the start and at the end of the run."""
    embedded: bool = False
    """The model is the embedded SmolLM2, which the time goal is set on."""
    passages: int = 1
    """Evaluation passages per kind, spread over its files (as `kvrig bench quality` reads them)."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "goals": self.goals()}

    def goals(self) -> list[dict[str, Any]]:
        """The goals this run can judge, each {goal, met, best}: kvrig's recipes within GOAL_SECONDS on the
        embedded SmolLM2 (one stopped at its timeout counts as missed), and each scaled recipe's time growing no faster
        than parameters x hidden size."""
        out: list[dict[str, Any]] = []
        # The goal is the layer-by-layer fits'; a distilled recipe (+kd) trains for minutes by design.
        ours = [r for r in self.runs if r.by == "kvrig" and not parse_weights(r.recipe).distill_steps]
        if self.embedded and ours:
            timed = [r for r in ours if r.seconds is not None]
            out.append(
                {
                    "goal": f"kvrig's recipes (imx, gpx) quantize the embedded SmolLM2 in <= {GOAL_SECONDS:g} s "
                    f"(wall, calibration included; {self.cpus} CPUs)",
                    "met": len(timed) == len(ours) and all((r.seconds or 0) <= GOAL_SECONDS for r in timed),
                    "best": ", ".join(
                        f"{r.recipe} {r.seconds:.1f} s" if r.seconds is not None else f"{r.recipe} skipped"
                        for r in ours
                    ),
                }
            )
        if (scaled := self.scaling_ratios()) is not None:
            growth, ratios = scaled
            a, b = self.scaling
            out += [
                {
                    "goal": f"{name}'s time grows no faster than parameters x hidden size (x{growth:.2f})",
                    "met": ratio <= growth,
                    "best": f"hidden {a.hidden} -> {b.hidden}: x{ratio:.2f}",
                }
                for name, ratio in ratios.items()
            ]
        return out

    def scaling_ratios(self) -> tuple[float, dict[str, float]] | None:
        """(how much parameters x hidden size grew, how much each recipe's time grew) between the two scaling
        points; None without them."""
        if len(self.scaling) != 2:
            return None
        a, b = self.scaling
        return b.params * b.hidden / (a.params * a.hidden), {n: b.seconds[n] / a.seconds[n] for n in a.seconds}

    def lines(self) -> list[str]:
        """The report as text: one row per recipe (perplexity and its change per evaluation kind), then the
        scaling check."""
        kinds = list(self.source_ppl)
        width = {k: max(14, len("PPL " + column_label(k)) + 2) for k in kinds}
        out = [
            f"model {self.model}; {self.cpus} CPUs, load average {' -> '.join(f'{v:.1f}' for v in self.load_average)}",
            *(f"calibration {k}: {', '.join(files)}" for k, files in self.calibration.items()),
            *(
                f"evaluation {k} ({self.passages} passages of {self.tokens} tokens spread over it): {', '.join(files)}"
                for k, files in self.evaluation.items()
            ),
            "source perplexity " + ", ".join(f"{k} {v:.3f}" for k, v in self.source_ppl.items()),
            "",
            f"{'recipe':12}{'by':8}{'seconds':>9}{'cpu s':>8}{'bits/w':>8}"
            + "".join(f"{'PPL ' + column_label(k):>{width[k]}}{'change':>9}" for k in kinds)
            + f"{'peak RSS':>10}",
        ]
        for r in self.runs:
            if r.skipped is not None or r.ppl is None:
                out.append(f"{r.recipe:12}{r.by:8}  skipped: {r.skipped}")
                continue
            delta = r.ppl_delta_pct or {}
            out.append(
                f"{r.recipe:12}{r.by:8}{r.seconds or 0:9.1f}{r.cpu_seconds or 0:8.1f}{r.bits_per_weight or 0:8.3f}"
                + "".join(f"{r.ppl.get(k, 0):{width[k]}.3f}{delta.get(k, 0):+8.2f}%" for k in kinds)
                + f"{(r.peak_rss_bytes or 0) / 2**30:9.2f}G"
                + (f"  ({r.note})" if r.note else "")
            )
        if (scaled := self.scaling_ratios()) is not None:
            growth, ratios = scaled
            a, b = self.scaling
            out += [
                "",
                f"scaling: hidden {a.hidden} -> {b.hidden}: params x{b.params / a.params:.2f}, "
                f"params x hidden x{growth:.2f}",
            ]
            out += [
                f"  {name:10} {a.seconds[name]:6.2f} s -> {b.seconds[name]:6.2f} s: x{ratio:.2f}"
                for name, ratio in ratios.items()
            ]
        if goals := self.goals():
            out += ["", "The goals this run judged:"]
            out += [f"- [{'met' if g['met'] else 'MISSED'}] {g['goal']}: {g['best']}" for g in goals]
        return out


def run_quantize_bench(
    model: str | Path | None,
    *,
    recipes: tuple[str, ...] = DEFAULT_RECIPES,
    tokens: int = 512,
    passages: int = 4,
    kinds: tuple[str, ...] = EVALUATION_KINDS,
    timeout: float = DEFAULT_TIMEOUT,
    scaling: bool = True,
    progress: Callable[[str], None] = lambda _: None,
) -> QuantizeReport:
    """Quantizes MODEL (a model folder, GGUF or bundle; None: the embedded SmolLM2) with each recipe in its
    own process and measures it against the unquantized source on `kinds` (texts.py kinds calibration never
    reads, or text files); then, with `scaling`, times kvrig's quantizers on two tiny models."""
    for k in kinds:
        evaluation_kind(k, "--kinds")  # before minutes of loading: a misspelt kind, or calibration text

    load = [os.getloadavg()[0]]
    embedded = model is None or _is_embedded(Path(model))
    with bench_source(model) as (src, name, _):
        tokenizer = read_tokenizer(src)
        ids = {k: kind_segments(tokenizer, k, passages, tokens + 1) for k in kinds}
        progress(f"source: perplexity on {passages} x {tokens} tokens of each of {', '.join(kinds)}")
        source, _ = load_weights(src, "source", None)
        spec = load_model_spec(src / "config.json")
        base = passages_ppl(source, spec, ids)
        del source
        runs = []
        for recipe in recipes:
            progress(f"{recipe}: quantizing (timeout {timeout:g} s)")
            run = _in_child(src, recipe, ids, timeout)
            if run.ppl is not None:
                run.ppl_delta_pct = {k: 100 * (v / base[k] - 1) for k, v in run.ppl.items()}
            measured = ", ".join(f"{k} {v:.3f}" for k, v in (run.ppl or {}).items())
            progress(
                f"{recipe}: " + (f"skipped: {run.skipped}" if run.skipped else f"{run.seconds:.1f} s, PPL {measured}")
            )
            runs.append(run)
    points = scaling_check(progress) if scaling else []
    load.append(os.getloadavg()[0])
    return QuantizeReport(
        name,
        calibration_files(),
        {k: read_kind(k)[1] for k in kinds},
        tokens,
        base,
        timeout,
        runs,
        points,
        os.cpu_count() or 0,
        load,
        embedded=embedded,
        passages=passages,
    )


def _is_embedded(path: Path) -> bool:
    """Whether `path` is the embedded SmolLM2 (False where it is not installed: the path is another model)."""
    try:
        return path.resolve() == embedded_default_model().resolve()
    except ModelConfigError:
        return False


def method_of(recipe: str) -> str:
    """Who quantizes with `recipe`: kvrig or mlx-lm (dwq-qN is mlx-lm's DWQ from the qN layout)."""
    if recipe.startswith("dwq-"):
        return "mlx-lm"
    return {"imx": "kvrig", "gpx": "kvrig", "none": "-"}.get(parse_weights(recipe).method, "mlx-lm")


def _in_child(src: Path, recipe: str, ids: dict[str, list[list[int]]], timeout: float) -> RecipeRun:
    """One recipe in a child process; its result, or why there is none."""
    try:
        by = method_of(recipe)
    except KvrigError as exc:
        return RecipeRun(recipe, "?", skipped=str(exc))
    job = json.dumps({"source": str(src), "recipe": recipe, "ids": ids, "timeout": timeout})
    try:
        # The child stops itself at the timeout; this one only catches a child that cannot.
        done = subprocess.run(
            [sys.executable, "-m", "kvrig.quality.quantize_bench"],
            input=job,
            stdout=subprocess.PIPE,
            text=True,
            env=preload_env(),
            timeout=timeout + 600,
        )
    except subprocess.TimeoutExpired:
        return RecipeRun(recipe, by, skipped=f"did not finish within {timeout:g} s (the process was killed)")
    lines = done.stdout.strip().splitlines()
    if done.returncode < 0:
        return RecipeRun(recipe, by, skipped=f"the process died of signal {-done.returncode} (out of memory?)")
    if not lines:
        return RecipeRun(recipe, by, skipped=f"the process failed (exit {done.returncode}) without a result")
    return RecipeRun(**json.loads(lines[-1]))


def scaling_check(progress: Callable[[str], None] = lambda _: None) -> list[ScalingPoint]:
    """kvrig's quantizers (SCALING_RECIPES) timed on two tiny llama models built from their arguments, hidden
    sizes SCALING_HIDDEN: the time should grow no faster than parameters x hidden size."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    from kvrig.quantize.recipes import apply_recipe

    points = []
    for hidden in SCALING_HIDDEN:
        config: dict[str, Any] = {
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_attention_heads": max(1, hidden // 64),
            "num_key_value_heads": max(1, hidden // 128),
            "num_hidden_layers": 4,
            "rms_norm_eps": 1e-5,
            "vocab_size": SCALING_VOCAB,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "float16",
        }
        mx.random.seed(0)
        calibration = mx.random.randint(0, SCALING_VOCAB, (16, 256))
        seconds = {}
        for recipe in SCALING_RECIPES:
            model = Model(ModelArgs.from_dict(config))
            mx.eval(model.parameters())
            flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
            params = sum(v.size for _, v in flat)
            progress(f"scaling: {recipe} on a {params / 1e6:.1f} M-parameter model (hidden {hidden})")
            start = time.perf_counter()
            apply_recipe(model, dict(config), parse_weights(recipe), calibration)
            seconds[recipe] = time.perf_counter() - start
        points.append(ScalingPoint(hidden, params, seconds))
    return points


# --- the child process -------------------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    """This process's peak resident set: getrusage's ru_maxrss, in KiB on Linux and in bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _measure(job: dict[str, Any]) -> RecipeRun:
    """Quantizes the source with the job's recipe within its timeout and measures perplexity on its tokens."""
    import mlx.core as mx
    from mlx_lm.utils import compute_bits_per_weight

    from kvrig.planner.layout import quantized_layout
    from kvrig.quantize.base import load_source_model
    from kvrig.quantize.recipes import apply_recipe, calibration_rows, calibration_tokens, distill_dwq
    from kvrig.runtime.host import prepare_for_host

    src, recipe, timeout = Path(job["source"]), job["recipe"], float(job["timeout"])
    run = RecipeRun(recipe, method_of(recipe))
    tokenizer = read_tokenizer(src)
    model, config = load_source_model(src)
    last = [""]  # what the quantizer said last, for a recipe stopped at its timeout

    def progress(line: str) -> None:
        last[0] = f"last: {line} at {time.perf_counter() - wall:.0f} s"
        print(f"  {recipe}: {line}", file=sys.stderr, flush=True)

    def dwq_progress(line: str) -> None:
        last[0] = f"last: {line} started at {time.perf_counter() - wall:.0f} s"
        print(f"  {recipe}: {line}", file=sys.stderr, flush=True)

    wall, cpu = time.perf_counter(), time.process_time()
    with _timeout(run, timeout, last):
        if recipe.startswith("dwq-"):
            rows = calibration_tokens(tokenizer, samples=20)
            model, config, steps = distill_dwq(
                model, config, parse_weights(recipe[4:]), rows[:16], rows[16:], progress=dwq_progress
            )
        else:
            weights = parse_weights(recipe)
            rows = calibration_rows(weights)
            calibration = calibration_tokens(tokenizer, samples=rows) if weights.calibrated else None
            model, config = apply_recipe(model, config, weights, calibration, progress)
        mx.eval(model.parameters())
        run.seconds, run.cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
    if recipe.startswith("dwq-"):
        hours = run.seconds / steps * DWQ_DEFAULT_STEPS * 4 / 3600
        run.note = f"{steps} steps over the calibration rows; mlx-lm's defaults would take ~{hours:.0f} h here"
    run.layers = len(quantized_layout(model))
    run.bits_per_weight = float(compute_bits_per_weight(model))
    host = prepare_for_host(model)
    spec = load_model_spec(src / "config.json")
    run.ppl = passages_ppl(host, spec, job["ids"])
    run.peak_rss_bytes = peak_rss_bytes()
    return run


@contextlib.contextmanager
def _timeout(run: RecipeRun, seconds: float, status: list[str]) -> Iterator[None]:
    """Ends the process with `run` marked skipped when the block takes longer than `seconds` (and status[0],
    what the quantizer reported last)."""

    def stop() -> None:
        run.skipped = f"did not finish within its {seconds:g} s timeout" + (f" ({status[0]})" if status[0] else "")
        print(json.dumps(asdict(run)), file=sys.__stdout__, flush=True)  # the result line, past the redirect
        os._exit(0)

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _child() -> None:
    job = json.loads(sys.stdin.read())
    try:
        # Everything but the result goes to stderr (mlx-lm prints its bits per weight to stdout).
        with contextlib.redirect_stdout(sys.stderr):
            run = _measure(job)
    except KvrigError as exc:
        run = RecipeRun(job["recipe"], method_of(job["recipe"]), skipped=str(exc))
    except Exception as exc:  # mlx-lm's own refusals (ValueError, ...): named in the report, not a crash of it
        run = RecipeRun(job["recipe"], method_of(job["recipe"]), skipped=f"failed: {type(exc).__name__}: {exc}")
    print(json.dumps(asdict(run)), flush=True)


if __name__ == "__main__":
    _child()
