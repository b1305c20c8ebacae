"""`kvrig package`: the pipeline that writes a bundle. Source (converted from GGUF when needed) → plan for the
device → quantized weights, tokenizer, kvcache.json → quality gate → manifest.json, all in a hidden folder that
is renamed into place at the end, so a folder with the output's name is always complete; with `replace`
an existing bundle there is swapped for the new one in one rename (Linux `renameat2(RENAME_EXCHANGE)`).
The format itself (options, kvcache.json, manifest and verify) is `kvrig.bundle`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvrig.bundle.kvcache_json import build_kvcache_config, host_config
from kvrig.bundle.manifest import hash_files
from kvrig.bundle.mapped import PAGE_BYTES, align_file
from kvrig.bundle.options import MLX_CACHE_STEP, PackageOptions, PlanView, check_app_kv, resolve_kv
from kvrig.exceptions import (
    BundleExistsError,
    BundleWriteError,
    DoesNotFitError,
    InputError,
    ModelConfigError,
    OutputWriteError,
    QualityGateError,
    QuantizationError,
)
from kvrig.fileio import scratch_dir, swap_in, sweep_scratch
from kvrig.kvcache.caches import cache_settings
from kvrig.kvcache.families import APP_UNQUANTIZED_KV
from kvrig.models import load_model_spec, spec_from_config
from kvrig.models.gguf import embedded_default_model
from kvrig.models.source import CONVERT_PREFIX, read_tokenizer, source_dir
from kvrig.planner import PlanRequest, plan_memory
from kvrig.planner.kv import check_dims
from kvrig.profiles import list_profiles, load_profile
from kvrig.quality.choose import FIT_KV, choose_kv, measure_kv, rank_fit
from kvrig.quality.gate import (
    Enough,
    GateTexts,
    enforce,
    gate_tokens,
    judge,
    kind_perplexities,
    over_limit,
    unmeasured,
)
from kvrig.quality.kv_sensitivity import resolve_for_source
from kvrig.quality.measured import Measurements, cache_root, ids_digest, source_digest
from kvrig.quantize.base import load_source_model
from kvrig.quantize.recipes import CalibrationStatistics, apply_recipe, calibration_rows, calibration_tokens
from kvrig.recipes import AUTO, WEIGHT_CANDIDATES, KVSpec, WeightRecipe, parse_kv, parse_weights
from kvrig.runtime.host import load_bundle_model, prepare_for_host
from kvrig.schemas.bundle import (
    MANIFEST_NAME,
    Candidate,
    Choice,
    Manifest,
    Prediction,
    QualityCheck,
    Recipe,
    SourceModel,
)
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig
from kvrig.texts import read_kind, user_kind
from kvrig.version import __version__

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass
class PackageResult:
    path: Path
    manifest: Manifest
    kvcache: KVCacheConfig
    warnings: list[str] = field(default_factory=list)


# --- the plan (adapter: the one place that calls the planner) ---------------------------------------------


def plan_for_bundle(config_path: Path, device: str, recipe: WeightRecipe, scheme: KVSpec) -> PlanView:
    """Calls the planner for one weight recipe and KV scheme on one device."""
    plan = plan_memory(
        load_model_spec(config_path),
        load_profile(device),
        PlanRequest(
            schemes=(scheme.name,),
            weights=recipe.name,
            recipes=(recipe.name,),
            group_size=recipe.group_size,
            kv_group_size=scheme.group_size,
        ),
    )
    # MLX's own limit sits below jetsam's: the app's non-MLX memory (runtime, UI baseline) lives in the gap.
    return PlanView(
        device=plan.device.name,
        limit_bytes=plan.limit_bytes,
        weights_bytes=plan.weights_bytes,
        kv_bytes_per_token=plan.kv_bytes_per_token[scheme.name],
        max_context=plan.max_context[scheme.name],
        memory_limit_bytes=max(0, plan.budget_bytes - plan.runtime.baseline_bytes),
    )


def check_fits(plan: PlanView, *, min_context: int, ignore: bool) -> list[str]:
    """Refuses (DoesNotFitError) when the plan's max context is below `min_context`, saying by how much."""
    if plan.max_context >= min_context:
        return []
    short_tokens = min_context - max(plan.max_context, 0)
    short_bytes = _mib(short_tokens * plan.kv_bytes_per_token)
    if plan.max_context <= 0:
        over = plan.weights_bytes - plan.limit_bytes
        how = (
            f"the weights alone ({_mib(plan.weights_bytes)}) exceed the {_mib(plan.limit_bytes)} limit by {_mib(over)}"
            if over > 0
            else f"weights and fixed overhead leave no room for the KV cache under the "
            f"{_mib(plan.limit_bytes)} limit; {min_context} tokens need {short_bytes} more"
        )
    else:
        how = (
            f"max context is {plan.max_context} tokens, {short_tokens} short of {min_context} "
            f"({short_bytes} over the {_mib(plan.limit_bytes)} limit)"
        )
    message = f"does not fit on {plan.device}: {how}"
    if not ignore:
        raise DoesNotFitError(message + "; use --ignore-fit to package anyway")
    return [message + " (packaged anyway: --ignore-fit)"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# --- packaging --------------------------------------------------------------------------------------------


class _Job:
    """One `package` call's source and what it measures once: the model spec, the tokenizer, the unquantized
    model prepared for the host and the gate's texts with its perplexity on them (read from the measurement
    cache when this source was measured before: quality/measured.py)."""

    def __init__(self, src_dir: Path, source_info: SourceModel, out: Path, options: PackageOptions, work: Path) -> None:
        self.src_dir, self.source_info, self.out, self.options = src_dir, source_info, out, options
        self.work = work  # the run's scratch folder beside `out`, where candidates are staged
        self._staged = 0
        self.config_path = src_dir / "config.json"
        self.spec = load_model_spec(self.config_path)  # first: it holds the file to its depth and size claims
        self.config: dict[str, Any] = json.loads(self.config_path.read_text())
        self._tokenizer: Any = None
        self._source: Any = None
        self._texts: GateTexts | None = None
        self._ids: dict[str, list[list[int]]] | None = None
        # What calibrated recipes measure on the source, measured once for every recipe this call tries.
        self.statistics = CalibrationStatistics()
        self.say = options.progress
        self._measurements: Measurements | None = None

    @property
    def tokenizer(self) -> Any:
        """The source's tokenizer, read when first needed (a plan that refuses needs none)."""
        if self._tokenizer is None:
            self._tokenizer = read_tokenizer(self.src_dir)
        return self._tokenizer

    def source(self) -> Any:
        if self._source is None:
            self._source = prepare_for_host(load_source_model(self.src_dir)[0])
        return self._source

    def measurements(self) -> Measurements:
        if self._measurements is None:
            root = cache_root() if self.options.cache else None
            given = Path(self.source_info.path)
            self._measurements = Measurements(root, source_digest(given, self.source_info.sha256))
        return self._measurements

    def measured(
        self,
        what: str,
        extra: dict[str, Any],
        ids: dict[str, list[list[int]]],
        measure: Callable[[], dict[str, float]],
        enough: Enough | None = None,
    ) -> dict[str, float]:
        """Per-kind perplexities of `what` on the passages `ids`: measured, or read from the cache (`enough`:
        gate.kind_perplexities', which `measure` must pass on)."""

        def run() -> dict[str, float]:
            self.say(f"measuring {what} on the gate's texts ...")
            return measure()

        values, cached = self.measurements().perplexities({"measured": what, **extra}, ids, run, enough=enough)
        if cached:
            self.say(f"{what} on the gate's texts: measured before ({self.measurements().root})")
        return values

    def gate_ids(self) -> dict[str, list[list[int]]]:
        """The gate's passages, tokenized once (a user's text too short for them is refused here)."""
        if self._ids is None:
            self._ids = gate_tokens(self.tokenizer, self.options.gate_texts)
        return self._ids

    def texts(self) -> GateTexts:
        if self._texts is None:
            ids = self.gate_ids()
            ppl = self.measured(
                "the unquantized model", {}, ids, lambda: kind_perplexities(self.source(), None, "", ids)
            )
            self._texts = GateTexts(ids, ppl)
        return self._texts

    def source_with_kv(self, kv: KVCacheConfig, enough: Enough | None = None) -> dict[str, float]:
        """The source's perplexities through the caches `kv` makes (`--kv auto`, `--fit`)."""
        return self.measured(
            f"the unquantized weights with {kv.scheme} KV"
            + (f" ({kv.rotation} rotation)" if kv.rotation != "none" else ""),
            {"kv": cache_settings(kv)},
            self.texts().ids,
            lambda: kind_perplexities(self.source(), kv, self.spec.model_type, self.texts().ids, enough=enough),
            enough,
        )

    def drop_source(self) -> None:
        self._source = None  # its memory goes back before quantized candidates load

    def stage_dir(self) -> Path:
        """A new folder in the scratch folder for one candidate bundle (renamed to `out` when it is kept)."""
        self._staged += 1
        return self.work / f"candidate-{self._staged}"


def package(model: str | Path | None, out: str | Path, options: PackageOptions) -> PackageResult:
    """Quantizes `model` (HF directory, GGUF file, None: the embedded SmolLM2) into a bundle at `out`. `auto`
    weights or KV, and `fit`, choose by measuring on the model (quality/choose.py); the manifest records what
    was tried."""
    out = Path(out)
    _sweep_leftovers(out)
    _check_options(options)
    source = _check_paths(model, out, replace=options.replace)
    with contextlib.ExitStack() as stack:
        with _disk_errors(out.parent):
            src_dir, source_info = stack.enter_context(source_dir(source, scratch_parent=out.parent))
        # Every staged candidate lives in one hidden folder, locked for this run: removed on every way out
        # (SIGTERM too), and swept by the next run beside it when a SIGKILL left it.
        with _disk_errors(out.parent / f".{out.name}.partial-"):
            work = stack.enter_context(scratch_dir(out.parent, f".{out.name}.partial-"))
        job = _Job(src_dir, source_info, out, options, work)
        if options.gate_texts and options.quality_gate:
            job.gate_ids()  # a user's text too short for the gate's passages: refused before minutes of quantizing
        if options.fit is not None:
            return _package_fit(job, options.fit)
        kv, choice = _choose_kv(job)
        if options.weights.strip().lower() == AUTO:
            return _package_auto_weights(job, kv, choice)
        recipe = parse_weights(options.weights, options.group_size)
        plan, warnings = _plan(job, recipe, kv)
        staged = _stage(job, recipe, kv, plan)
        quality = _gate(job, staged, recipe, kv, enforce_it=True)
        return _finish(job, staged, recipe, kv, plan, quality, choice, warnings)


def _sweep_leftovers(out: Path) -> None:
    """What a SIGKILLed `kvrig package` beside `out` left (its hidden bundle, its GGUF conversion) goes first."""
    sweep_scratch(out.parent, f".{out.name}.partial-")
    sweep_scratch(out.parent, CONVERT_PREFIX)


def _check_options(options: PackageOptions) -> None:
    """What can be refused before any model is read: the recipe, the KV spec, the device, `fit` without one."""
    if options.device is not None:
        load_profile(options.device)  # a misspelt device is refused now, not after minutes of measuring
    if options.weights.strip().lower() != AUTO:
        parse_weights(options.weights, options.group_size)
    if options.kv.strip().lower() != AUTO:
        parse_kv(options.kv)
    if options.gate_texts and not options.quality_gate:
        raise InputError(
            "--gate-text is read by the quality gate, which is off",
            field="--gate-text",
            expected="the gate on (no --no-quality-gate), or no --gate-text",
        )
    for path in options.gate_texts:
        read_kind(user_kind(path))  # missing, unreadable or not text: refused before minutes of quantizing
    if options.fit is not None:
        if options.device is None:
            raise InputError("--fit needs a device to plan for", field="--fit", expected="--device D as well")
        if options.fit < 1:
            raise InputError(f"--fit {options.fit}", field="--fit", expected="a context of at least 1 token")


def _check_paths(model: str | Path | None, out: Path, *, replace: bool) -> Path:
    """The source to read (refused when unreadable), after making sure `out` may be written."""
    _check_output(out, replace=replace)
    source = Path(model) if model is not None else embedded_default_model()
    _check_readable_source(source)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BundleWriteError(f"{out.parent}: cannot create the output folder: {exc.strerror or exc}") from None
    return source


def _resolve_kv(job: _Job, kv: KVSpec) -> KVSpec:
    """`+kN@topM` resolved to the layers measured on the source, checked against the model's head dims."""
    spec = spec_from_config(job.config, job.config_path)
    check_app_kv(spec.model_type, kv)
    if kv.promote_keys is not None:
        check_dims(spec, replace(kv, promote_keys=None))  # the measurement quantizes keys at these dims
        kv = resolve_for_source(job.src_dir, kv)
    check_dims(spec, kv)
    return kv


def _choose_kv(job: _Job) -> tuple[KVSpec, Choice | None]:
    text = job.options.kv.strip().lower()
    if text != AUTO:
        return _resolve_kv(job, parse_kv(text)), None
    if job.spec.model_type in APP_UNQUANTIZED_KV:
        job.say(f"  --kv auto: fp16 ({job.spec.model_type}: the app keeps its KV unquantized)")
        return parse_kv("fp16"), None
    if not job.options.quality_gate:
        # Nothing measured without the gate: `auto` is the rule it was before measurement, rotation where allowed.
        return _resolve_kv(job, resolve_kv(AUTO, job.config, job.config_path)), None
    job.say("choosing the KV spec (--kv auto) ...")
    kv, candidates, why = choose_kv(job.source_with_kv, job.spec, job.texts())
    job.say(f"  {why}")
    return _resolve_kv(job, kv), Choice(kv=candidates, kv_why=why)


def _plan(job: _Job, recipe: WeightRecipe, kv: KVSpec) -> tuple[PlanView | None, list[str]]:
    if job.options.device is None:
        return None, []
    plan = plan_for_bundle(job.config_path, job.options.device, recipe, kv)
    return plan, check_fits(plan, min_context=MLX_CACHE_STEP, ignore=job.options.ignore_fit)


@dataclass
class _Staged:
    """A bundle written into a hidden folder beside the output, not yet gated or installed."""

    path: Path
    quant_config: dict[str, Any]
    kvcache: KVCacheConfig


def _stage(job: _Job, recipe: WeightRecipe, kv: KVSpec, plan: PlanView | None) -> _Staged:
    """Weights, tokenizer and kvcache.json into a folder of the run's scratch folder; removed on any error."""
    job.tokenizer  # noqa: B018 - read before minutes of quantizing: a bundle needs a tokenizer that loads
    tmp = job.stage_dir()
    try:
        with _disk_errors(tmp):
            tmp.mkdir()
            job.say(f"quantizing the weights ({recipe}) ...")
            # Calibrated recipes (imx, gpx) name each layer as it is done: minutes on a big model.
            q_config = _write_weights(job.src_dir, tmp, recipe, lambda line: job.say(f"  {line}"), job.statistics)
            if job.options.weights_layout == "mapped":
                for weights in sorted(tmp.glob("*.safetensors")):
                    align_file(weights, PAGE_BYTES)
            _copy_tokenizer(job.src_dir, tmp)
            kvcache = build_kvcache_config(job.config, job.spec, kv, job.options, plan)
            (tmp / KVCACHE_NAME).write_text(kvcache.model_dump_json(by_alias=True, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _Staged(tmp, q_config, kvcache)


def _gate(job: _Job, staged: _Staged, recipe: WeightRecipe, kv: KVSpec, *, enforce_it: bool) -> QualityCheck | None:
    """The quality gate on the staged bundle (None when turned off); with `enforce_it` a failure raises
    (QualityGateError, unless forced) and the staged folder is removed. Without it (a candidate of `--weights
    auto`) the measurement stops at the first text over the limit: the candidate has failed, and the next one
    is measured instead."""
    if not job.options.quality_gate:
        return None
    try:
        texts = job.texts()
        job.drop_source()
        began = time.perf_counter()
        limit = job.options.max_ppl_increase_pct
        enough = None if enforce_it else over_limit(texts, limit)

        def measure() -> dict[str, float]:
            model, _, config = load_bundle_model(staged.path)
            model_type = str(config.get("model_type", ""))
            return kind_perplexities(model, staged.kvcache, model_type, texts.ids, enough=enough)

        # Keyed by the staged bundle's files but kvcache.json, and what of kvcache.json its caches read: the same
        # weights with the same KV spec measure the same, whatever device or prefill step the plan was for.
        weights = source_digest(staged.path, skip=frozenset({KVCACHE_NAME, MANIFEST_NAME}))
        what = {"bundle": weights, "kv": cache_settings(staged.kvcache)}
        ppl = job.measured(f"the {recipe.name} bundle", what, texts.ids, measure, enough)
        check = judge(ppl, texts, max_increase_pct=limit, began=began)
        left = unmeasured(texts, ppl)
        stopped = f"; {', '.join(left)} not measured" if left else ""
        job.say(
            f"  quality gate: {check.ppl_delta_pct:+.2f} % on the worst text "
            f"({'passed' if check.passed else 'failed'}{stopped})"
        )
        return enforce(check, force=job.options.ignore_gate, recipe=recipe.name, kv=kv.name) if enforce_it else check
    except BaseException:
        shutil.rmtree(staged.path, ignore_errors=True)
        raise


def _unmeasured_reason(check: QualityCheck, texts: GateTexts) -> str:
    """A failed candidate measured only up to its first text over the limit says so (its figure is that text's)."""
    left = unmeasured(texts, (k.kind for k in check.kinds))
    if not left:
        return ""
    worst = max(check.kinds, key=lambda k: k.ppl_delta_pct).kind
    return f"over the limit on {worst}; {', '.join(left)} not measured"


def _finish(
    job: _Job,
    staged: _Staged,
    recipe: WeightRecipe,
    kv: KVSpec,
    plan: PlanView | None,
    quality: QualityCheck | None,
    choice: Choice | None,
    warnings: list[str],
) -> PackageResult:
    """The manifest over every staged file, then the folder renamed into place."""
    try:
        with _disk_errors(staged.path):
            manifest = Manifest(
                tool_version=__version__,
                created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                source=job.source_info,
                recipe=Recipe(
                    weights=recipe.name,
                    bits=staged.quant_config.get("quantization", {}).get("bits"),
                    group_size=recipe.group_size,
                    kv_scheme=kv.scheme,
                    kv=kv.name,
                    key_bits=kv.key_bits,
                    value_bits=kv.value_bits,
                    kv_group_size=kv.group_size,
                    weights_layout=job.options.weights_layout,
                    weights_alignment_bytes=staged.kvcache.weights_alignment_bytes,
                ),
                prediction=_prediction(plan, forced=bool(warnings)),
                quality=quality,
                choice=choice,
                files=list(hash_files(staged.path)),
            )
            (staged.path / MANIFEST_NAME).write_text(manifest.model_dump_json(by_alias=True, indent=2) + "\n")
            _install(staged.path, job.out, replace=job.options.replace)
    except BaseException:
        shutil.rmtree(staged.path, ignore_errors=True)
        raise
    return PackageResult(job.out, manifest, staged.kvcache, warnings)


def _package_auto_weights(job: _Job, kv: KVSpec, choice: Choice | None) -> PackageResult:
    """`--weights auto`: each candidate, smallest first, written and gated; the first that passes is kept."""
    choice = choice or Choice()
    tried: list[Candidate] = []
    if not job.options.quality_gate:
        raise InputError(
            "--weights auto chooses by the quality gate",
            field="--no-quality-gate",
            expected="the gate on, or --weights R",
        )
    for name in WEIGHT_CANDIDATES:
        recipe = parse_weights(name)
        try:
            plan, warnings = _plan(job, recipe, kv)
        except QuantizationError as exc:
            tried.append(Candidate(weights=name, kv=kv.name, verdict="unavailable", reason=str(exc)))
            continue
        except DoesNotFitError as exc:
            tried.append(Candidate(weights=name, kv=kv.name, verdict="does not fit", reason=str(exc)))
            break  # every later candidate is larger
        staged = _stage(job, recipe, kv, plan)
        check = _gate(job, staged, recipe, kv, enforce_it=False)
        assert check is not None
        written, bits = _weights_written(staged.path)
        entry = Candidate(
            weights=name,
            kv=kv.name,
            # the plan's bytes are these (MLX's nbytes); without a device there is no plan, the bundle still counts
            weights_bytes=plan.weights_bytes if plan else written,
            max_context=plan.max_context if plan else None,
            bits_per_weight=bits,
            ppl_delta_pct=check.ppl_delta_pct,
            verdict="passed" if check.passed else "failed gate",
            reason=_unmeasured_reason(check, job.texts()),
        )
        if check.passed:
            tried.append(entry.model_copy(update={"verdict": "chosen"}))
            tried += [
                Candidate(weights=n, kv=kv.name, verdict="not tried", reason="a smaller recipe passed")
                for n in WEIGHT_CANDIDATES[WEIGHT_CANDIDATES.index(name) + 1 :]
            ]
            why = (
                f"{name}: the smallest recipe whose bundle passes the gate ({check.ppl_delta_pct:+.2f} % on its worst "
                f"text, limit {check.max_increase_pct:g} %)"
            )
            job.say(f"  {why}")
            choice = choice.model_copy(update={"weights": tried, "weights_why": why})
            return _finish(job, staged, recipe, kv, plan, check, choice, warnings)
        tried.append(entry)
        shutil.rmtree(staged.path, ignore_errors=True)
    summary = "; ".join(
        f"{c.weights}: {c.verdict}" + (f" ({c.ppl_delta_pct:+.1f} %)" if c.ppl_delta_pct is not None else "")
        for c in tried
    )
    raise QualityGateError(
        f"--weights auto: no candidate passes the quality gate ({summary}); raise --max-ppl-increase, or give "
        "--weights R (with --ignore-gate to package it anyway)"
    )


def _package_fit(job: _Job, context: int) -> PackageResult:
    """`--fit N`: the weights x KV pairs the plan says hold N tokens on the device, best measured quality first;
    the first whose bundle passes the gate is kept. Nothing fits: DoesNotFitError naming the closest option."""
    assert job.options.device is not None
    profile = load_profile(job.options.device)
    app_fp16 = job.spec.model_type in APP_UNQUANTIZED_KV  # the app keeps this family's KV unquantized
    kv_names = tuple(n for n in FIT_KV if _dims_ok(job, parse_kv(n)) and not (app_fp16 and parse_kv(n).quantized))
    pairs = fit_pairs(job.spec, profile, WEIGHT_CANDIDATES, kv_names, context)
    fitting = [p for p in pairs if p.verdict == "passed"]
    if not fitting:
        raise DoesNotFitError(_closest(job, profile.name, pairs, context))
    job.say(f"{len(fitting)} of {len(pairs)} weights x KV pairs hold {context} tokens on {profile.name}; measuring ...")
    kv_delta = {
        c.kv: c.ppl_delta_pct
        for c in measure_kv(job.source_with_kv, job.spec, job.texts(), tuple({p.kv for p in fitting}))
        if c.ppl_delta_pct is not None
    }
    weights_delta = _measure_weights(job, tuple(dict.fromkeys(p.weights for p in fitting)))
    ranked = rank_fit(pairs, weights_delta, kv_delta)
    candidates = {(p.weights, p.kv): p for p in pairs}
    for attempt, best in enumerate(ranked[:FIT_ATTEMPTS]):
        recipe, kv = parse_weights(best.weights), _resolve_kv(job, parse_kv(best.kv))
        plan, warnings = _plan(job, recipe, kv)
        staged = _stage(job, recipe, kv, plan)
        check = _gate(job, staged, recipe, kv, enforce_it=False)
        assert check is not None
        if not check.passed:
            reason = f"combined {check.ppl_delta_pct:+.2f} % on its worst text"
            if stopped := _unmeasured_reason(check, job.texts()):
                reason += f" ({stopped})"
            candidates[(best.weights, best.kv)] = best.model_copy(update={"verdict": "failed gate", "reason": reason})
            shutil.rmtree(staged.path, ignore_errors=True)
            continue
        candidates[(best.weights, best.kv)] = best.model_copy(update={"verdict": "chosen"})
        why = (
            f"{best.weights} + {best.kv}: holds {best.max_context} tokens (>= {context}) on {profile.name} and has the "
            f"best measured quality of the {len(fitting)} pairs that fit (weights and KV measured apart: "
            f"{best.ppl_delta_pct:+.2f} %; together, by the gate: {check.ppl_delta_pct:+.2f} %)"
            + (f"; {attempt} better-ranked pair(s) failed the gate together" if attempt else "")
        )
        job.say(f"  {why}")
        for key, pair in list(candidates.items()):
            if key not in {(b.weights, b.kv) for b in ranked[: attempt + 1]} and pair.verdict == "passed":
                scored = next((r for r in ranked if (r.weights, r.kv) == key), pair)
                candidates[key] = scored.model_copy(
                    update={"verdict": "not tried", "reason": "ranked below the winner"}
                )
        choice = Choice(fit_context=context, fit=list(candidates.values()), fit_why=why)
        return _finish(job, staged, recipe, kv, plan, check, choice, warnings)
    raise QualityGateError(
        f"--fit {context}: the {min(len(ranked), FIT_ATTEMPTS)} best-ranked pairs that hold {context} tokens on "
        f"{profile.name} failed the quality gate together; raise --max-ppl-increase or ask for less context"
    )


FIT_ATTEMPTS = 3
"""Pairs `--fit` writes and gates at most, best-ranked first, before it gives up."""


def fit_pairs(
    spec: Any, profile: Any, weights: tuple[str, ...], kv_names: tuple[str, ...], context: int
) -> list[Candidate]:
    """Every weights x KV pair with its planned bytes and max context on `profile` (one plan per recipe)."""
    pairs = []
    for name in weights:
        try:
            plan = plan_memory(spec, profile, PlanRequest(schemes=kv_names, weights=name, recipes=(name,)))
        except QuantizationError as exc:
            pairs += [Candidate(weights=name, kv=k, verdict="unavailable", reason=str(exc)) for k in kv_names]
            continue
        for kv in kv_names:
            kv_name = parse_kv(kv).name
            max_context = plan.max_context[kv_name]
            pairs.append(
                Candidate(
                    weights=name,
                    kv=kv,
                    weights_bytes=plan.weights_bytes,
                    kv_bytes=plan.kv_bytes[kv_name].get("4096") if "4096" in plan.kv_bytes[kv_name] else None,
                    max_context=max_context,
                    verdict="passed" if max_context >= context else "does not fit",
                )
            )
    return pairs


def _dims_ok(job: _Job, kv: KVSpec) -> bool:
    try:
        check_dims(job.spec, kv)
    except QuantizationError:
        return False
    return True


def _closest(job: _Job, device: str, pairs: list[Candidate], context: int) -> str:
    """What to say when nothing fits: the pair that comes closest (the model's own trained context, when that is
    what stops every pair), and the devices where the smallest pair holds the context."""
    planned = [p for p in pairs if p.max_context is not None]
    if not planned:
        return f"--fit {context}: no candidate recipe can be planned for this model"
    text = job.spec.config.get("text_config", job.spec.config)
    trained = text.get("max_position_embeddings")
    best = max(planned, key=lambda p: (p.max_context or 0, -(p.weights_bytes or 0) - (p.kv_bytes or 0)))
    if trained and best.max_context == int(trained):
        return (
            f"nothing holds {context} tokens: the model's trained context is {trained} tokens (max_position_embeddings "
            f"in {job.config_path.name}), which {best.weights} + {best.kv} already reaches on {device}"
        )
    smallest = min(planned, key=lambda p: (p.weights_bytes or 0, p.kv_bytes or 0))
    holders = []
    request = PlanRequest(schemes=(smallest.kv,), weights=smallest.weights, recipes=(smallest.weights,))
    for profile in list_profiles():
        try:
            plan = plan_memory(job.spec, profile, request)
        except QuantizationError:
            continue
        if plan.max_context[parse_kv(smallest.kv).name] >= context:
            holders.append(profile.name)
    where = (
        f"; {smallest.weights} + {smallest.kv} would hold it on {', '.join(holders[:5])}"
        if holders
        else "; no device kvrig knows holds it with these candidates"
    )
    return (
        f"nothing holds {context} tokens on {device}: the closest is {best.weights} + {best.kv} at "
        f"{best.max_context} tokens{where}"
    )


def _measure_weights(job: _Job, names: tuple[str, ...]) -> dict[str, float]:
    """Each recipe's worst-kind perplexity change with an unquantized KV cache, quantized in memory."""

    texts = job.texts()
    fp16 = host_config(job.spec, parse_kv("fp16"))
    recipes = {name: parse_weights(name) for name in names}
    rows = max((calibration_rows(r) for r in recipes.values() if r.calibrated), default=0)
    calibration: Any = calibration_tokens(job.tokenizer, samples=rows) if rows else None
    out = {}
    for name, recipe in recipes.items():
        used = calibration[: calibration_rows(recipe)] if recipe.calibrated else None

        def measure(recipe: WeightRecipe = recipe, used: Any = used) -> dict[str, float]:
            source = load_source_model(job.src_dir)[0]
            model, _ = apply_recipe(source, dict(job.config), recipe, used, statistics=job.statistics)
            return kind_perplexities(prepare_for_host(model), fp16, job.spec.model_type, texts.ids)

        # The calibration tokens come from texts on this machine: another machine's may differ.
        extra = {
            "kv": fp16.model_dump(mode="json", by_alias=True),
            "calibration": ids_digest(used.tolist()) if used is not None else None,
        }
        out[name] = judge(job.measured(f"{name} weights", extra, texts.ids, measure), texts).ppl_delta_pct
    return out


def _weights_written(bundle: Path) -> tuple[int, float]:
    """MLX's nbytes of the written bundle's arrays, and its bits per weight as mlx-lm counts them
    (compute_bits_per_weight: those bytes over the parameters), on the model mlx-lm loads from it lazily (nothing
    is read but the headers)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import compute_bits_per_weight, load_model

    model = load_model(bundle, lazy=True)[0]
    arrays: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return sum(a.nbytes for _, a in arrays), round(compute_bits_per_weight(model), 3)


def _check_output(out: Path, *, replace: bool) -> None:
    """An existing output folder is replaced only with `replace`, and only if it is a bundle (or empty)."""
    if not out.exists() and not out.is_symlink():
        return
    if not replace:
        raise BundleExistsError(f"{out}: output folder already exists; use --replace to replace it, or another -o")
    if out.is_symlink() or not out.is_dir():
        raise BundleExistsError(f"{out}: exists and is not a folder; not replacing it")
    if not (out / MANIFEST_NAME).is_file() and any(out.iterdir()):
        raise BundleExistsError(f"{out}: exists and is not a kvrig bundle (no {MANIFEST_NAME}); not replacing it")


def _install(tmp: Path, out: Path, *, replace: bool) -> None:
    """Renames the finished bundle into place; with `replace` an existing one is swapped out, then removed."""
    if out.exists() or out.is_symlink():
        _check_output(out, replace=replace)  # again: it may have appeared while we quantized
    swap_in(tmp, out)


def _prediction(plan: PlanView | None, *, forced: bool) -> Prediction | None:
    if plan is None:
        return None
    return Prediction(
        device=plan.device,
        limit_bytes=plan.limit_bytes,
        weights_bytes=plan.weights_bytes,
        kv_bytes_per_token=plan.kv_bytes_per_token,
        max_context=plan.max_context,
        fits=not forced,
        forced=forced,
    )


def _check_readable_source(source: Path) -> None:
    if not source.exists():
        raise ModelConfigError("model not found", file=source, expected="a Hugging Face directory or a .gguf file")
    if source.is_dir():
        try:
            names = {p.name for p in source.iterdir()}
        except OSError as exc:
            raise ModelConfigError(f"cannot read the model directory: {exc.strerror or exc}", file=source) from None
        if "config.json" not in names:
            raise ModelConfigError("no config.json in the model directory", file=source)
        if not any(n.endswith(".safetensors") for n in names):
            raise ModelConfigError("no *.safetensors weights in the model directory", file=source)
        if not os.access(source / "config.json", os.R_OK):
            raise ModelConfigError("cannot read config.json", file=source / "config.json")
    elif not os.access(source, os.R_OK):
        raise ModelConfigError("cannot read the model file", file=source)


@contextlib.contextmanager
def _disk_errors(where: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise BundleWriteError(
                f"{where}: disk full while writing the bundle ({exc.strerror}); nothing was kept"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise BundleWriteError(f"{where}: cannot write: {exc.strerror}") from None
        raise
    except OutputWriteError as exc:  # a GGUF conversion that could not write its scratch folder
        raise BundleWriteError(f"{exc}; nothing was kept") from None
    except _WeightsWriteFailed as exc:
        free = shutil.disk_usage(where.parent).free
        reason = "disk full" if free < 64 * 2**20 else "write failed"
        raise BundleWriteError(f"{where}: {reason} while writing the bundle ({exc}); nothing was kept") from None


class _WeightsWriteFailed(Exception):
    """MLX's safetensors writer failed (MLX raises RuntimeError without an errno for it)."""


def _write_weights(
    src_dir: Path,
    dst: Path,
    recipe: WeightRecipe,
    progress: Callable[[str], None] | None = None,
    statistics: CalibrationStatistics | None = None,
) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    model, config = load_source_model(src_dir)
    calibration = (
        calibration_tokens(read_tokenizer(src_dir), samples=calibration_rows(recipe)) if recipe.calibrated else None
    )
    model, config = apply_recipe(model, config, recipe, calibration, progress or (lambda _: None), statistics)
    mx.eval(model.parameters())  # computed here, so a RuntimeError from the save below is the write's
    try:
        save_model(dst, model, donate_model=True)
    except RuntimeError as exc:  # MLX reports a failed safetensors write without an errno
        raise _WeightsWriteFailed(str(exc)) from exc
    save_config(config, config_path=dst / "config.json")
    return config


def _copy_tokenizer(src_dir: Path, dst: Path) -> None:
    found = [n for n in TOKENIZER_FILES if (src_dir / n).is_file()]
    if "tokenizer.json" not in found and "tokenizer.model" not in found:
        raise ModelConfigError("no tokenizer.json or tokenizer.model", file=src_dir)
    for name in found:
        shutil.copyfile(src_dir / name, dst / name)
