"""`kvrig bench quality`: perplexity of weight recipes and KV specs against the unquantized source on each kind
of evaluation text (kinds the calibration never saw, texts.py), KV bytes measured from the caches next to the
planner's prediction, host decode tok/s by context, plots.

Weight rows run `weights_passages` passages of `weights_tokens` tokens spread over each kind (one passage is a
narrow sample of a kind), with an unquantized KV cache; KV rows run the source weights (so only the cache
differs) over `kv_passages` passages of `kv_tokens` tokens spread the same way, each from an empty cache. Each
row is one perplexity per kind over all its passages. Every delta is against the source with an unquantized
cache on the same tokens, measured in the same run."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvrig.bundle.kvcache_json import host_config
from kvrig.bundle.manifest import load_manifest
from kvrig.bundle.options import package_default_kv
from kvrig.fileio import atomic_write
from kvrig.models import load_model_spec
from kvrig.models.gguf import embedded_default_model
from kvrig.models.source import read_tokenizer, source_dir
from kvrig.planner.kv import context_schedule, kv_bytes
from kvrig.quality.gate import kind_perplexity, worst_first
from kvrig.quality.kv_sensitivity import resolve_variant, sensitivity_tokens
from kvrig.quality.schemes import make_kv_caches
from kvrig.quantize.base import load_source_model
from kvrig.quantize.recipes import apply_recipe, calibration_files, calibration_rows, calibration_tokens
from kvrig.recipes import KVSpec, parse_kv, parse_weights
from kvrig.runtime.generate import encode_prompt, generate_tokens
from kvrig.runtime.host import load_bundle_model, prepare_for_host
from kvrig.schemas.bundle import MANIFEST_NAME
from kvrig.schemas.quality import FactualCheck, QualityReport, Row
from kvrig.texts import EVALUATION_KINDS, evaluation_kind, kind_segments, read_kind

# awq-q4 is left out: mlx-lm's AWQ takes longer per layer here than the rest together (ask for it with --recipes).
DEFAULT_RECIPES = ("q4", "q4g32", "q8", "mixed_4_6", "gptq-q4", "dq-4.6", "imx-4.6", "gpx-q4", "gpx-4.6")
DEFAULT_KV = (
    "fp16",
    "k8v8",
    "k8v4",
    "k8v4+rot",
    "k4v4",
    "k4v4+rot",
    "k4v4+rot+s4",
    "k4v4+rot+s4+w64",
    "k5v3",
    "k5v3+rot",
    "k5v3+rot+s4+w64",
)
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096)
FACTUAL_PROMPTS = (
    ("What is the capital of France?", "paris"),
    ("What is the largest planet in our solar system?", "jupiter"),
    ("How many days are there in a week?", "seven|7"),
)

# Goals (SmolLM2-135M), each on every evaluation kind; the bench prints whether this run met them.
GOAL_RECIPES = ((4.6, 5.0), (4.0, 10.0))
"""(bits per weight at most, PPL increase at most): a recipe that small within that much on every kind."""
GOAL_ROT_K8V4_DELTA = 0.5
GOAL_KV_FRACTION, GOAL_KV_DELTA, GOAL_CONTEXT = 0.25, 2.0, 4096


@contextlib.contextmanager
def bench_source(model: str | Path | None) -> Iterator[tuple[Path, str, Path | None]]:
    """(HF-layout source directory, a name, the bundle or None) for a model path, a GGUF, a bundle (its
    manifest names the source) or None (the embedded SmolLM2)."""
    bundle = None
    path = Path(model) if model is not None else embedded_default_model()
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        bundle = path
        path = Path(load_manifest(path).source.path)
    with source_dir(path) as (src, _):
        yield src, path.name, bundle


class Tally:
    """The quantizer's progress for a bench or a package that runs many recipes: its line per layer and per
    distillation step become a count shown every `every_s` seconds, and once more before the next other line and
    at the end (so each recipe's count closes before what follows it); other lines pass."""

    KINDS = (("quantized ", "layers quantized"), ("distilled step ", "distillation steps"))

    def __init__(self, progress: Callable[[str], None], every_s: float = 10.0) -> None:
        self.progress, self.every_s = progress, every_s
        self.counts = {what: 0 for _, what in self.KINDS}
        self.shown = time.monotonic()
        self.indent = ""  # the counted lines' own (package indents a recipe's steps)

    def __call__(self, line: str) -> None:
        text = line.lstrip()
        what = next((what for prefix, what in self.KINDS if text.startswith(prefix)), None)
        if what is None:
            self.close()
            self.progress(line)
            return
        self.indent = line[: len(line) - len(text)]
        self.counts[what] += 1
        if time.monotonic() - self.shown >= self.every_s:
            self.progress(f"{self.indent}{what}: {self.counts[what]} (last: {text})")
            self.shown = time.monotonic()

    def close(self) -> None:
        done = [f"{what}: {n}" for what, n in self.counts.items() if n]
        if done:
            self.progress(self.indent + ", ".join(done))
        self.counts = dict.fromkeys(self.counts, 0)


def load_weights(
    src: Path, recipe: str, calibration: Any, progress: Callable[[str], None] = lambda _: None
) -> tuple[Any, float | None]:
    """Source weights quantized by `recipe` ("source": unquantized), prepared for the host; `progress` hears what
    the quantizer reports (`apply_recipe`)."""
    from mlx_lm.utils import compute_bits_per_weight

    model, config = load_source_model(src)
    bpw = None
    if recipe != "source":
        weights = parse_weights(recipe)
        rows = calibration[: calibration_rows(weights)] if calibration is not None else None
        model, config = apply_recipe(model, config, weights, rows, progress)
        bpw = float(compute_bits_per_weight(model))
    return prepare_for_host(model), bpw


def decode_speed(
    model: Any, spec: Any, variant: KVSpec, contexts: tuple[int, ...], *, steps: int = 8, chunk: int = 256
) -> tuple[dict[int, float], dict[int, int], dict[int, int]]:
    """Decode tok/s at each context, with the caches filled by random keys and values (attention costs the same
    whatever they hold); also the caches' bytes at each context and the planner's bytes for that schedule."""
    import mlx.core as mx

    caches = make_kv_caches(model, spec, variant)
    layers = [layer for layer in spec.layers if layer.kind != "shared"]
    schedule: list[int] = []
    tps, measured, predicted = {}, {}, {}
    offset = 0
    token = mx.array([[1]])
    for ctx in sorted(contexts):
        while offset < ctx:
            n = min(chunk, ctx - offset)
            for layer, cache in zip(layers, caches, strict=True):
                k = mx.random.normal((1, layer.kv_heads, n, layer.k_head_dim)).astype(mx.float32)
                v = mx.random.normal((1, layer.kv_heads, n, layer.v_head_dim)).astype(mx.float32)
                cache.update_and_fetch(k, v)
            mx.eval([c.state for c in caches])
            schedule.append(n)
            offset += n
        measured[ctx] = sum(int(c.nbytes) for c in caches)
        predicted[ctx] = kv_bytes(spec, replace(variant, dtype="float32"), schedule)
        mx.eval(model(token, cache=caches))  # warm-up step, not timed
        t0 = time.perf_counter()
        for _ in range(steps):
            mx.eval(model(token, cache=caches))
        tps[ctx] = steps / (time.perf_counter() - t0)
        schedule += [1] * (steps + 1)
        offset += steps + 1
        mx.clear_cache()
    return tps, measured, predicted


def paired_decode(
    model: Any, spec: Any, names: tuple[str, ...], context: int, *, steps: int = 8, chunk: int = 256
) -> dict[str, float]:
    """Decode tok/s of several variants at one context, their steps interleaved (a, b, a, b, ...) so a machine
    whose load changes during the run slows every variant alike: the ratio is the side-by-side number."""
    import mlx.core as mx

    layers = [layer for layer in spec.layers if layer.kind != "shared"]
    sets = {}
    for name in names:
        caches = make_kv_caches(model, spec, parse_kv(name))
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            for layer, cache in zip(layers, caches, strict=True):
                k = mx.random.normal((1, layer.kv_heads, n, layer.k_head_dim))
                v = mx.random.normal((1, layer.kv_heads, n, layer.v_head_dim))
                cache.update_and_fetch(k, v)
            mx.eval([c.state for c in caches])
        sets[name] = caches
    token = mx.array([[1]])
    seconds = dict.fromkeys(names, 0.0)
    for step in range(steps + 1):
        for name in names:
            t0 = time.perf_counter()
            mx.eval(model(token, cache=sets[name]))
            if step:  # the first round warms up
                seconds[name] += time.perf_counter() - t0
    return {name: steps / seconds[name] for name in names}


def greedy_answer(model: Any, tokenizer: Any, prompt: str, spec: Any, kv: str = "fp16", max_tokens: int = 16) -> str:
    """Greedy answer to a chat prompt through the path `kvrig run` and the app take (mlx-lm's generate_step:
    the prompt but its last token prefilled, then one token at a time) with caches of the KV variant `kv`.
    A direct forward pass of the whole prompt reads the cache differently and, on a model this small, can
    flip an answer the real path gets right."""

    variant = parse_kv(kv)
    ids = encode_prompt(tokenizer, prompt, chat=True)
    stop = set(getattr(tokenizer, "eos_token_ids", None) or [])
    caches = make_kv_caches(model, spec, variant)
    out = [
        t
        for t in generate_tokens(
            model,
            ids,
            caches,
            host_config(spec, variant),
            max_tokens=max_tokens,
            stop_tokens=stop,
            model_type=spec.model_type,
        )
        if t not in stop
    ]
    return str(tokenizer.decode(out)).strip()


def run_quality_bench(
    model: str | Path | None,
    *,
    recipes: tuple[str, ...] = DEFAULT_RECIPES,
    kv_variants: tuple[str, ...] = DEFAULT_KV,
    kinds: tuple[str, ...] = EVALUATION_KINDS,
    weights_tokens: int = 512,
    weights_passages: int = 4,
    kv_tokens: int = 2048,
    kv_passages: int = 4,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    decode_steps: int = 8,
    kv_reads: str = "decoded",
    factual_recipe: str | None = "q8",
    factual_kv: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> QualityReport:

    variants = unquantized_first([parse_kv(v) for v in kv_variants])
    weights_recipes = [parse_weights(r) for r in recipes]
    for k in kinds:
        evaluation_kind(k, "--kinds")  # before minutes of loading: a misspelt kind, or calibration text
    with bench_source(model) as (src, name, bundle):
        tokenizer = read_tokenizer(src)
        spec = load_model_spec(src / "config.json")
        kv_ids, passages, text = {}, {}, {}
        for k in kinds:
            text[k] = read_kind(k)[1]
            if weights_recipes or bundle is not None:
                passages[k] = kind_segments(tokenizer, k, weights_passages, weights_tokens + 1)
            if variants:
                kv_ids[k] = kind_segments(tokenizer, k, kv_passages, kv_tokens + 1)
        calibrated = [r for r in weights_recipes if r.calibrated]
        if factual_recipe and parse_weights(factual_recipe).calibrated:
            calibrated.append(parse_weights(factual_recipe))
        needs_calibration = bool(calibrated)
        samples = max((calibration_rows(r) for r in calibrated), default=0)
        calibration = calibration_tokens(tokenizer, samples=samples) if needs_calibration else None
        report = QualityReport(
            model=name, text=text, calibration=calibration_files() if needs_calibration else {}, kv_reads=kv_reads
        )
        source, _ = load_weights(src, "source", None)
        report.weights = _weight_rows(
            src,
            bundle,
            source,
            spec,
            [str(r) for r in weights_recipes],
            passages,
            calibration,
            report,
            progress,
        )
        report.kv = _kv_rows(
            source, spec, tokenizer, variants, kv_ids, contexts, decode_steps, kv_reads, report, progress
        )
        names = {v.name for v in variants}
        if {"fp16", "k8v4"} <= names and GOAL_CONTEXT in contexts:
            paired = ("fp16", "k8v4", *(["k8v4+rot"] if "k8v4+rot" in names else []))
            progress(f"decode at {GOAL_CONTEXT}: {', '.join(paired)} interleaved")
            report.paired_decode_tps = paired_decode(source, spec, paired, GOAL_CONTEXT, steps=decode_steps)
        if factual_recipe:
            factual_kv = factual_kv or package_default_kv(src)
            progress(f"factual prompts: source vs {factual_recipe} with {factual_kv} KV")
            report.factual_recipe, report.factual_kv = factual_recipe, factual_kv
            quant, _ = load_weights(src, factual_recipe, calibration)
            report.factual = [
                factual_check(source, quant, tokenizer, p, e, spec, factual_kv) for p, e in FACTUAL_PROMPTS
            ]
        report.goals = goals(report)
    return report


def _weight_rows(
    src: Path,
    bundle: Path | None,
    source: Any,
    spec: Any,
    recipes: list[str],
    passages: dict[str, list[list[int]]],
    calibration: Any,
    report: QualityReport,
    progress: Callable[[str], None],
) -> list[Row]:
    """Each recipe quantized once, its perplexity over every kind's passages against the source's (fp KV
    throughout)."""
    if not passages:
        return []
    shape = {k: (len(p), len(p[0]) - 1) for k, p in passages.items()}  # passages, tokens each
    base = passages_ppl(source, spec, passages)
    for k, (count, tokens) in shape.items():
        report.source_ppl[f"{k}/{count}x{tokens}"] = base[k]
    rows = []
    names = ([f"bundle:{bundle.name}"] if bundle is not None else []) + recipes
    for recipe in names:
        progress(f"weights {recipe}")
        t0 = time.perf_counter()
        if recipe.startswith("bundle:"):
            assert bundle is not None
            from mlx_lm.utils import compute_bits_per_weight

            m = load_bundle_model(bundle)[0]
            bpw: float | None = float(compute_bits_per_weight(m))
        else:
            tally = Tally(lambda line: progress(f"  {line}"))
            m, bpw = load_weights(src, recipe, calibration, tally)
            tally.close()
        quantized = time.perf_counter() - t0
        measured = passages_ppl(m, spec, passages)
        for k, (count, tokens) in shape.items():
            ppl = measured[k]
            delta = 100 * (ppl / base[k] - 1)
            rows.append(
                Row(
                    recipe=recipe,
                    kv="fp16",
                    kind=k,
                    ppl=ppl,
                    ppl_delta_pct=delta,
                    tokens=tokens,
                    bits_per_weight=bpw,
                    seconds=quantized,
                    passages=count,
                )
            )
            progress(f"  {k}: ppl {ppl:.3f} ({rows[-1].ppl_delta_pct:+.2f} %), {bpw:.3f} bits/weight")
        del m
    return rows


def passages_ppl(model: Any, spec: Any, passages: dict[str, list[list[int]]]) -> dict[str, float]:
    """`model`'s perplexity over each kind's passages, each read from an empty unquantized cache."""
    fp = parse_kv("fp16")
    return {k: kind_perplexity(model, ids, lambda: make_kv_caches(model, spec, fp)) for k, ids in passages.items()}


def _kv_rows(
    source: Any,
    spec: Any,
    tokenizer: Any,
    variants: list[KVSpec],
    passages: dict[str, list[list[int]]],
    contexts: tuple[int, ...],
    decode_steps: int,
    kv_reads: str,
    report: QualityReport,
    progress: Callable[[str], None],
) -> list[Row]:
    """Each KV spec's perplexity over every kind's passages (source weights, each passage from empty caches)
    against the unquantized cache's; its bytes and decode speed once (they do not depend on the text)."""
    base: dict[str, float] = {}
    rows = []
    for variant in variants:
        requested = variant.name  # the row keeps the name asked for; kv_scheme says which layers it chose
        progress(f"kv {requested}")
        t0 = time.perf_counter()
        if variant.promote_keys is not None:
            variant = resolve_variant(source, spec, variant, sensitivity_tokens(tokenizer))
            progress(f"  layers chosen: {variant.scheme}")
        tps, measured, predicted = decode_speed(source, spec, variant, contexts, steps=decode_steps)
        phone = {c: kv_bytes(spec, replace(variant, dtype="float16"), context_schedule(c, 256)) for c in contexts}

        def caches(variant: KVSpec = variant) -> list[Any]:
            made = make_kv_caches(source, spec, variant)
            for cache in made:
                cache.per_query_window = kv_reads == "decoded"
            return made

        for k, kind_passages in passages.items():
            count, tokens = len(kind_passages), len(kind_passages[0]) - 1
            ppl = kind_perplexity(source, kind_passages, caches)
            if k not in base:  # the first variant is the unquantized cache
                base[k] = ppl
                report.source_ppl[f"{k}/{count}x{tokens}"] = ppl
            rows.append(
                Row(
                    recipe="source",
                    kv=requested,
                    kind=k,
                    ppl=ppl,
                    ppl_delta_pct=100 * (ppl / base[k] - 1),
                    tokens=tokens,
                    seconds=time.perf_counter() - t0,
                    kv_bytes=measured,
                    predicted_kv_bytes=predicted,
                    phone_kv_bytes=phone,
                    decode_tps={c: round(t, 3) for c, t in tps.items()},
                    kv_scheme=variant.scheme,
                    passages=count,
                )
            )
            progress(f"  {k}: ppl {ppl:.3f} ({rows[-1].ppl_delta_pct:+.2f} %)")
        progress(f"  decode {tps}")
    return rows


def factual_check(
    source: Any, model: Any, tokenizer: Any, prompt: str, expected: str, spec: Any, kv: str
) -> FactualCheck:
    """The source with an fp cache vs `model` with the KV variant `kv`."""
    import re

    a, b = greedy_answer(source, tokenizer, prompt, spec), greedy_answer(model, tokenizer, prompt, spec, kv)
    pat = re.compile(rf"\b({expected})\b", re.IGNORECASE)
    return FactualCheck(
        prompt=prompt,
        expected=expected,
        source_answer=a,
        answer=b,
        source_ok=bool(pat.search(a)),
        ok=bool(pat.search(b)),
    )


def unquantized_first(variants: list[KVSpec]) -> list[KVSpec]:
    """The KV rows in the order they are read: every row is measured against the unquantized cache, so the first
    unquantized one asked for comes first (fp16 is added when none is)."""
    if not variants:
        return []
    plain = next((v for v in variants if not v.quantized), parse_kv("fp16"))
    return [plain, *(v for v in variants if v is not plain)]


def worst_by_name(rows: list[Row], key: Callable[[Row], str]) -> dict[str, Row]:
    """Per name (a recipe, a KV spec), its row on the kind where it does worst."""
    worst: dict[str, Row] = {}
    for row in rows:
        name = key(row)
        if name not in worst or worst_first(row.ppl_delta_pct) > worst_first(worst[name].ppl_delta_pct):
            worst[name] = row
    return worst


def goals(report: QualityReport) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    kinds = ", ".join(report.text)
    recipes = worst_by_name(report.weights, lambda r: r.recipe)
    # A run judges the goals of what it measured: weight goals with weight rows, KV goals with KV rows.
    for bpw_limit, delta in GOAL_RECIPES if report.weights else ():
        small = [r for r in recipes.values() if r.bits_per_weight is not None and r.bits_per_weight <= bpw_limit]
        best = min(small, key=lambda r: worst_first(r.ppl_delta_pct), default=None)
        out.append(
            {
                "goal": f"a <= {bpw_limit} bits/weight recipe within +{delta} % PPL on every kind ({kinds})",
                "met": best is not None and best.ppl_delta_pct <= delta,
                "best": None
                if best is None
                else f"{best.recipe}: {best.bits_per_weight:.3f} bpw, worst {best.ppl_delta_pct:+.2f} % ({best.kind})",
            }
        )
    kv = worst_by_name(report.kv, lambda r: r.kv)
    rot = kv.get("k8v4+rot")
    if report.kv:
        out.append(
            {
                "goal": f"rotated k8v4 within +{GOAL_ROT_K8V4_DELTA} % of fp16 KV on every kind",
                "met": rot is not None and rot.ppl_delta_pct <= GOAL_ROT_K8V4_DELTA,
                "best": None if rot is None else f"k8v4+rot: worst {rot.ppl_delta_pct:+.2f} % ({rot.kind})",
            }
        )
    fp = kv.get("fp16")
    if fp is not None and GOAL_CONTEXT in fp.phone_kv_bytes:
        full = fp.phone_kv_bytes[GOAL_CONTEXT]
        small_kv = [r for r in kv.values() if r.phone_kv_bytes.get(GOAL_CONTEXT, full) <= GOAL_KV_FRACTION * full]
        best_kv = min(small_kv, key=lambda r: worst_first(r.ppl_delta_pct), default=None)
        out.append(
            {
                "goal": f"KV <= {GOAL_KV_FRACTION:.0%} of fp16 bytes at {GOAL_CONTEXT} with <= +{GOAL_KV_DELTA} % "
                "PPL on every kind",
                "met": best_kv is not None and best_kv.ppl_delta_pct <= GOAL_KV_DELTA,
                "best": None
                if best_kv is None
                else f"{best_kv.kv}: {best_kv.phone_kv_bytes[GOAL_CONTEXT] / full:.1%} of fp16, worst "
                f"{best_kv.ppl_delta_pct:+.2f} % ({best_kv.kind})",
            }
        )
    paired = report.paired_decode_tps
    if paired.get("fp16") and "k8v4" in paired:
        ratio = paired["k8v4"] / paired["fp16"]
        rotated = f"; k8v4+rot / fp16 = {paired['k8v4+rot'] / paired['fp16']:.2f}x" if "k8v4+rot" in paired else ""
        out.append(
            {
                "goal": f"decode at {GOAL_CONTEXT} (steps interleaved): k8v4 no slower than fp16",
                "met": ratio >= 1.0,
                "best": f"k8v4 / fp16 = {ratio:.2f}x{rotated}",
            }
        )
    if report.factual:
        same = all(c.ok == c.source_ok for c in report.factual) and all(c.ok for c in report.factual if c.source_ok)
        out.append(
            {
                "goal": f"{report.factual_recipe} weights with {report.factual_kv} KV answer factual prompts as the "
                "unquantized model does",
                "met": same,
                "best": "; ".join(
                    f"{c.expected.split('|')[0]}: {'ok' if c.ok else 'wrong'}{'' if c.source_ok else ' (source too)'}"
                    for c in report.factual
                ),
            }
        )
    return out


def write_plots(report: QualityReport, out: Path) -> list[Path]:
    """kv_memory.png (measured and planned KV bytes against context; with KV variants) and ppl_delta.png (PPL
    change per weight recipe and per KV variant)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if report.kv:  # a run without KV variants (--kv '') has no KV memory to plot
        fig, ax = plt.subplots(figsize=(7, 4.5))
        first_kind = report.kv[0].kind
        for row in (r for r in report.kv if r.kind == first_kind):  # bytes do not depend on the text
            ctx = sorted(row.phone_kv_bytes)
            line = ax.plot(ctx, [row.phone_kv_bytes[c] / 2**20 for c in ctx], label=f"{row.kv} (plan, fp16 phone)")[0]
            m = sorted(row.kv_bytes)
            ax.scatter(m, [row.kv_bytes[c] / 2**20 / 2 for c in m], color=line.get_color(), marker="x", s=18)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("KV cache (MiB)")
        ax.set_title(f"{report.model}: KV memory vs context (x: host-measured bytes / 2)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "kv_memory.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    a1.barh([f"{r.recipe} ({r.kind})" for r in report.weights], [r.ppl_delta_pct for r in report.weights])
    a1.set_xlabel("PPL change vs source (%)")
    a1.set_title("weight recipes (fp KV), per kind of text")
    a2.barh([f"{r.kv} ({r.kind})" for r in report.kv], [r.ppl_delta_pct for r in report.kv], color="tab:orange")
    a2.set_xlabel("PPL change vs fp KV (%)")
    a2.set_title("KV specs (source weights), per kind of text")
    fig.tight_layout()
    paths.append(out / "ppl_delta.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    atomic_write(out / "quality.json", json.dumps(report.to_json(), indent=2) + "\n")
    paths.append(out / "quality.json")
    return paths
