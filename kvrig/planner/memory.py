"""The memory plan: what fits on a device, scheme by scheme, and which scheme to use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field

from kvrig.exceptions import PlanInputError, QuantizationError
from kvrig.kvcache.families import APP_UNQUANTIZED_KV
from kvrig.models.spec import ModelSpec
from kvrig.planner.allocator import AllocatorPolicy, AppModel, chat_run, trace_run
from kvrig.planner.kv import (
    ALL_NAMED_SCHEMES,
    MLX_STEP,
    bytes_per_token,
    check_dims,
    context_schedule,
    dequantized_read_bytes,
    dequantizes_on_read,
    kv_bytes,
    kv_bytes_detail,
    promoted_for_bytes,
    promotion_is_exact,
    row_bytes,
)
from kvrig.planner.runtime import (
    DEFAULT_BUFFER_CACHE_BYTES,
    DEFAULT_PREFILL_STEP,
    kv_read_bytes,
    prefill_activation_bytes,
    prefill_scores_bytes,
)
from kvrig.planner.transient import BACKENDS, DEFAULT_BACKEND, Backend
from kvrig.planner.weights import DEFAULT_RECIPES, WeightsAccount, account_weights
from kvrig.profiles import INCREASED_MEMORY_LIMIT, DeviceProfile
from kvrig.recipes import AUTO, DEFAULT_GROUP_SIZE, WEIGHT_CANDIDATES, KVSpec, parse_kv, parse_weights
from kvrig.schemas import StrictModel

PLAN_SCHEMA_VERSION: Final = 1
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_MARGIN = 0.10
SMALL_MODEL_PARAMS = 4_000_000_000  # below this, 4-bit keys hurt quality badly
WEAK_KEY_BITS = 4  # keys at this width or fewer count as 4-bit keys on a small model


def quality_rank(scheme: KVSpec) -> tuple[float, ...]:
    """Sorts KV specs best expected quality first, before anything is measured (`kvrig plan --quality` reads
    measurements): key bits, then value bits (keys are the sensitive half, so k8v4 beats k4v8 at equal size), a
    finer group, no layer's keys narrower than the rest, some layers' keys wider, then the extras that only add
    quality (rotation, a recent window, sink tokens); float16 before bfloat16."""
    unquantized = 32 if scheme.dtype == "float32" else 16
    base = scheme.key_bits or unquantized
    widths = [b for _, b in scheme.layer_key_bits]
    if scheme.promote_keys:  # `+kN@topM` before the model resolves it: M layers at N bits
        widths += [scheme.promote_keys[0]] * scheme.promote_keys[1]
    # Layers whose keys are wider than the rest only add quality; narrower ones (`k8v4+k4@0.1`) only take it away.
    promoted = sum(b > base for b in widths)
    demoted = sum(b < base for b in widths)
    return (
        -base,
        -(scheme.value_bits or unquantized),
        scheme.group_size,
        demoted,
        -max([base, *widths]),
        -promoted,
        scheme.rotation == "none",
        -scheme.recent_tokens,
        -scheme.sink_tokens,
        scheme.dtype != "float16",
    )


def _weak_keys(scheme: KVSpec) -> bool:
    """Some layer's keys at 4 bits or fewer (`k4v4`, or `k8v4+k4@0.1`)."""
    if scheme.key_bits is None:
        return False
    return min([scheme.key_bits, *(b for _, b in scheme.layer_key_bits)]) <= WEAK_KEY_BITS


class ModelSummary(StrictModel):
    source: str
    model_type: str
    layers: int
    parameters: int
    layer_kinds: dict[str, int]
    max_position_embeddings: int | None
    quantized_attention: bool


class DeviceSummary(StrictModel):
    name: str
    marketing_name: str
    product_types: list[str]
    ram_bytes: int
    ram_configurations_gb: list[int] = Field(
        description="RAM sizes sold under these ProductTypes (the plan's first unless --ram chose another)"
    )
    limit_default_bytes: int
    limit_entitled_bytes: int | None
    memory_bandwidth_bytes_per_s: float
    page_size_bytes: int
    baseline_bytes: int


APP_MODELS: Final[dict[str, str]] = {
    "kvrig": "kvrig's app: MLX's buffer cache capped at buffer_cache_bytes (Memory.cacheLimit), counted in full",
    "uncapped": "an app that never caps MLX's buffer cache: freed buffers MLX cannot reuse stay cached (growth "
    "copies, prefill chunks), replayed through MLX's allocator over the run (planner/allocator.py)",
}


class RuntimeTerms(StrictModel):
    app: AppModel = Field(
        default="kvrig", description="the app model: " + "; ".join(f"{k}: {v}" for k, v in APP_MODELS.items())
    )
    buffer_cache_bytes: int = Field(description="MLX buffer-cache cap (Memory.cacheLimit); 0 for an uncapped app")
    baseline_bytes: int = Field(description="app + Metal/runtime baseline: the device profile's estimate or calibrated")
    baseline_calibrated_from: str | None = Field(
        default=None, description="calibration file the baseline comes from (None: the profile's estimate)"
    )
    prefill_step: int
    backend: Backend = Field(
        default=DEFAULT_BACKEND,
        description="where MLX runs the app: metal (the phone, fused attention) or cpu (host, virtual iPhone)",
    )
    prefill_activation_bytes: dict[str, int] = Field(
        description="live prefill activations at each listed context over unquantized caches (per scheme: "
        "budget_at_max_context); attention scores as MLX holds them on the backend, the rest an upper bound"
    )
    generations: int = Field(default=1, description="uncapped app: generations in a row, the context growing evenly")
    decode_tokens: int = Field(default=0, description="uncapped app: tokens each generation decodes one at a time")


class SchemeBudget(StrictModel):
    """Where the bytes go at a scheme's max context."""

    context: int
    weights_bytes: int
    kv_bytes: int
    kv_growth_copy_bytes: int
    kv_dequantized_read_bytes: int
    prefill_activation_bytes: int
    buffer_cache_bytes: int
    baseline_bytes: int
    total_bytes: int


class GpuLimitsSummary(StrictModel):
    recommended_working_set_bytes: int | None = Field(
        default=None, description="Metal's recommendedMaxWorkingSetSize (the profile's; None: unknown)"
    )
    max_buffer_bytes: int | None = Field(default=None, description="Metal's maxBufferLength (None: unknown)")


class GpuCheck(StrictModel):
    """Metal's limits at a scheme's max context (jetsam's)."""

    context: int
    resident_bytes: int = Field(description="MLX's Metal buffers: weights, KV, growth copy, transients, cache")
    largest_buffer_bytes: int
    largest_buffer: Literal["kv_layer", "prefill_scores", "weights_array"]
    within_working_set: bool | None = Field(description="None: the device's working set is unknown")
    within_max_buffer: bool | None = Field(description="None: the device's largest buffer is unknown")


class MappedCheck(StrictModel):
    """Weights mapped from the bundle's file: outside the footprint, inside the mapped-memory ceiling, Metal's
    working set (gpu_check) and the phone's RAM."""

    mapped_bytes: int = Field(description="the weights, mapped read-only")
    ceiling_bytes: int = Field(description="how much of files the process may map (the limit kind's)")
    ceiling_basis: str = Field(description="the profile's basis and source for the ceiling")
    within_ceiling: bool
    ram_bytes: int
    ram_headroom_bytes: int = Field(
        description="RAM left beside the largest footprint and the mapped weights; negative: iOS drops clean weight "
        "pages and reads them back (slower decode), it does not kill for them"
    )


class Recommendation(StrictModel):
    scheme: str
    max_context: int
    reasons: list[str]


class MemoryPlan(StrictModel):
    schema_version: Literal[1] = Field(default=PLAN_SCHEMA_VERSION, alias="schema")
    model: ModelSummary
    device: DeviceSummary
    weights_recipe: str
    group_size: int
    kv_group_size: int
    dtype: str
    limit_kind: Literal["entitled", "default"]
    limit_bytes: int
    limit_requires: str | None = Field(
        default=None, description="the entitlement the app must declare for this limit (null: none)"
    )
    limit_measured_from: str | None = Field(
        default=None,
        description="the limits-registry entry limit_bytes comes from, a limit the phone stated in its log (file: "
        "ProductType, build, entitlement, runs); null: the device profile's",
    )
    margin: float
    budget_bytes: int = Field(description="limit × (1 − margin): what the plan fills")
    weights_bytes: int = Field(description="bytes of the weights under `weights_recipe`")
    weights_by_recipe: dict[str, int]
    weights_unavailable: dict[str, str] = Field(
        default_factory=dict,
        description="requested recipes this architecture cannot take, each with the reason (no bytes for them)",
    )
    active_weights_bytes: int = Field(description="weight bytes read per generated token (MoE: routed share)")
    runtime: RuntimeTerms
    kv_bytes_per_token: dict[str, int] = Field(description="steady state, per additional token, no step rounding")
    kv_constant_bytes: dict[str, int] = Field(description="sliding rings and linear-attention state at full size")
    kv_bytes: dict[str, dict[str, int]] = Field(description="allocated bytes (256-token steps) at listed contexts")
    max_context: dict[str, int] = Field(description="under limit_bytes with the margin")
    max_context_default_limit: dict[str, int] = Field(description="the same without the entitlement")
    limited_by: dict[str, Literal["memory", "model", "weights", "mapped_ceiling"]]
    budget_at_max_context: dict[str, SchemeBudget]
    decode_tps_ceiling: dict[str, dict[str, float]] = Field(
        description="ceiling, not a prediction: memory bandwidth / bytes read per token (weights + KV at context)"
    )
    recommendation: Recommendation
    notes: list[str]
    gpu_limits: GpuLimitsSummary = Field(default_factory=GpuLimitsSummary)
    gpu_check: dict[str, GpuCheck] = Field(default_factory=dict, description="Metal's limits at max_context")
    max_context_all_limits: dict[str, int] = Field(
        default_factory=dict, description="max context under jetsam and Metal's working set and largest buffer"
    )
    binding_limit: dict[
        str, Literal["jetsam", "metal_working_set", "metal_max_buffer", "model", "weights", "mapped_ceiling"]
    ] = Field(default_factory=dict, description="which limit sets max_context_all_limits")
    weights_residency: Literal["loaded", "mapped"] = Field(
        default="loaded",
        description="loaded: the weights count in the footprint; mapped: they are mapped from the bundle's file "
        "(kvrig package --weights-layout mapped) and count against `mapped` instead",
    )
    mapped: MappedCheck | None = Field(default=None, description="mapped residency only")
    buffer_cache_by_context: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="uncapped app: MLX's buffer cache when active + cached bytes peak over a run reaching each "
        "listed context, per scheme",
    )


def _limits(profile: DeviceProfile, limit: str) -> tuple[Literal["entitled", "default"], int]:
    if limit == "entitled" and profile.limit_entitled is not None:
        return "entitled", profile.limit_entitled
    return "default", profile.limit_default


def _peak_bytes(
    spec: ModelSpec,
    scheme: KVSpec,
    context: int,
    fixed: int,
    prefill_step: int,
    dtype: str,
    backend: Backend = DEFAULT_BACKEND,
) -> SchemeBudget:
    schedule = context_schedule(context, prefill_step)
    kv = kv_bytes_detail(spec, scheme, schedule)
    copy = kv.largest_cache if any(layer.grows for layer in spec.layers) else 0
    deq = dequantized_read_bytes(spec, scheme, context, backend)
    act = prefill_activation_bytes(spec, prefill_step, context, dtype, scheme=scheme, backend=backend)
    return SchemeBudget(
        context=context,
        weights_bytes=0,
        kv_bytes=kv.peak,
        kv_growth_copy_bytes=copy,
        kv_dequantized_read_bytes=deq,
        prefill_activation_bytes=act,
        buffer_cache_bytes=0,
        baseline_bytes=0,
        total_bytes=fixed + kv.peak + copy + deq + act,
    )


def largest_fitting(fits: Callable[[int], bool], estimate: int, cap: int) -> int:
    """Largest context in [1, cap] with fits(context), 0 if none; `fits` is monotone (bytes grow with the
    context). Starts at the closed-form estimate, walks whole 256-token steps to bracket the answer, then
    bisects inside one step: a handful of exact evaluations instead of a search over the whole range."""
    c = max(1, min(cap, estimate))
    if fits(c):
        good, bad = c, cap + 1
        step = MLX_STEP
        while good < cap:
            nxt = min(cap, good + step)
            if not fits(nxt):
                bad = nxt
                break
            good, step = nxt, step * 2
        else:
            return cap
    else:
        good, bad = 0, c
        step = MLX_STEP
        while bad > 1:
            nxt = max(1, bad - step)
            if fits(nxt):
                good = nxt
                break
            bad, step = nxt, step * 2
        else:
            return 0
    while good + 1 < bad:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def max_context_for(
    spec: ModelSpec,
    scheme: KVSpec,
    budget: int,
    fixed: int,
    prefill_step: int,
    dtype: str,
    cap: int,
    backend: Backend = DEFAULT_BACKEND,
) -> tuple[int, Literal["memory", "model", "weights"]]:
    """Largest context whose peak fits the budget: the closed-form solve, then MLX's exact bytes around it.

    Closed form: every term is affine in the context (caches in whole 256-token steps), so solve
    fixed + constant + per_token × C ≤ budget; the exact check settles the last step."""
    per_token = bytes_per_token(spec, scheme)
    copy_row = max((row_bytes(spec, scheme, layer) for layer in spec.layers if layer.grows), default=0)
    deq_row = dequantized_read_bytes(spec, scheme, 1, backend)
    ref = max(prefill_step, MLX_STEP) * 4
    act_ref, act_next = (
        prefill_activation_bytes(spec, prefill_step, c, dtype, scheme=scheme, backend=backend)
        for c in (ref, ref + MLX_STEP)
    )
    act_row = (act_next - act_ref) / MLX_STEP
    constant = kv_bytes(spec, scheme, context_schedule(ref, prefill_step)) - per_token * ref
    slope = per_token + copy_row + deq_row + act_row
    room = budget - fixed - constant - (act_ref - act_row * ref)
    estimate = cap if slope <= 0 else max(1, min(cap, int(room // slope) // MLX_STEP * MLX_STEP))

    def fits(c: int) -> bool:
        return _peak_bytes(spec, scheme, c, fixed, prefill_step, dtype, backend).total_bytes <= budget

    best = largest_fitting(fits, estimate, cap)
    if best == 0:
        return 0, "weights"
    return best, "model" if best == cap else "memory"


def _largest_buffer(
    spec: ModelSpec,
    scheme: KVSpec,
    context: int,
    prefill_step: int,
    dtype: str,
    weights_array: int,
    backend: Backend = DEFAULT_BACKEND,
) -> tuple[int, Literal["kv_layer", "prefill_scores", "weights_array"]]:
    kv = kv_bytes_detail(spec, scheme, context_schedule(context, prefill_step)).largest_array
    scores = prefill_scores_bytes(spec, prefill_step, context, dtype, scheme=scheme, backend=backend)
    options: list[tuple[int, Literal["kv_layer", "prefill_scores", "weights_array"]]] = [
        (weights_array, "weights_array"),
        (kv, "kv_layer"),
        (scores, "prefill_scores"),
    ]
    return max(options, key=lambda o: o[0])


def max_context_for_buffer(
    spec: ModelSpec,
    scheme: KVSpec,
    max_buffer: int,
    prefill_step: int,
    dtype: str,
    weights_array: int,
    cap: int,
    backend: Backend = DEFAULT_BACKEND,
) -> int:
    """Largest context whose largest single array fits Metal's largest buffer (it grows with the context)."""

    def fits(c: int) -> bool:
        return _largest_buffer(spec, scheme, c, prefill_step, dtype, weights_array, backend)[0] <= max_buffer

    per_token = max(1, _largest_buffer(spec, scheme, MLX_STEP, prefill_step, dtype, 0, backend)[0] // MLX_STEP)
    return largest_fitting(fits, max_buffer // per_token, cap)


def recommend(
    schemes: dict[str, KVSpec],
    max_context: dict[str, int],
    limited_by: dict[str, str],
    parameters: int,
    target_context: int | None,
    spec: ModelSpec,
) -> Recommendation:
    small = parameters < SMALL_MODEL_PARAMS
    fitting = [name for name in schemes if max_context.get(name, 0) > 0]
    candidates = sorted(fitting, key=lambda n: quality_rank(schemes[n]))
    reasons: list[str] = []
    if small:
        reasons.append(
            f"{parameters / 1e9:.2f}B parameters is under 4B: 4-bit keys degrade small models badly, so schemes with "
            "them are only considered last (Hadamard-rotating keys recovers much of the loss)."
        )
    reasons.append("Keys are more sensitive than values: k8v4 ranks above k4v8 at the same size.")
    if not candidates:
        return Recommendation(
            scheme="none",
            max_context=0,
            reasons=[*reasons, "No scheme fits: the weights and baseline alone exceed the budget."],
        )
    if small and len(candidates) > 1:
        candidates = [c for c in candidates if not _weak_keys(schemes[c])] + [
            c for c in candidates if _weak_keys(schemes[c])
        ]
    if target_context is not None:
        for name in candidates:
            if max_context[name] >= target_context:
                chosen = name
                reasons.append(
                    f"{name} is the highest-quality scheme that holds the target {target_context} tokens "
                    f"(max {max_context[name]})."
                )
                break
        else:
            chosen = max(candidates, key=lambda n: max_context[n])
            reasons.append(
                f"No scheme reaches {target_context} tokens; {chosen} holds the most ({max_context[chosen]})."
            )
    else:
        full = [n for n in candidates if limited_by.get(n) == "model"]
        if full:
            chosen = full[0]
            reasons.append(
                f"{chosen} is the highest-quality scheme that holds the model's whole trained context "
                f"({max_context[chosen]} tokens) within the budget."
            )
        else:
            pool = [c for c in candidates if not (small and _weak_keys(schemes[c]))] or candidates
            chosen = max(pool, key=lambda n: (max_context[n], -candidates.index(n)))
            reasons.append(
                f"Memory bounds every scheme; {chosen} gives the longest context ({max_context[chosen]} tokens) "
                "among schemes that keep quality."
            )
    scheme = schemes[chosen]
    if scheme.quantized and any(layer.kind == "sliding" for layer in spec.layers):
        reasons.append("Sliding-window layers stay unquantized (mlx-lm cannot quantize a rotating cache).")
    if dequantizes_on_read(scheme, spec):
        reasons.append(
            "This scheme needs kvrig's dequantize-on-read cache (mixed K/V bits or attention that cannot read "
            "quantized KV); its transient dequantized layer is counted."
        )
    return Recommendation(scheme=chosen, max_context=max_context[chosen], reasons=reasons)


MAX_CONTEXT: Final = 1 << 22
"""The longest context kvrig plans (`--cap none`): past any model's trained context, and a bound on the work a
mistyped context can ask for."""


class PlanRequest(StrictModel):
    """What to plan, typed: the CLI, demo, lab, calibration and packaging each build one. Every field defaults
    to the planner's default; `baseline_bytes` overrides the profile's estimated baseline (a calibration,
    `baseline_source` names it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schemes: tuple[str, ...] = ALL_NAMED_SCHEMES
    weights: str = AUTO
    recipes: tuple[str, ...] = DEFAULT_RECIPES
    group_size: int = 64
    kv_group_size: int | None = None
    dtype: str = "float16"
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    prefill_step: int = DEFAULT_PREFILL_STEP
    buffer_cache_bytes: int = DEFAULT_BUFFER_CACHE_BYTES
    margin: float = DEFAULT_MARGIN
    limit: Literal["entitled", "default"] = "entitled"
    target_context: int | None = None
    max_context_cap: int | None = None
    baseline_bytes: int | None = None
    baseline_source: str | None = None
    measured_limit_bytes: int | None = Field(
        default=None, gt=0, description="the limit a phone stated for `limit` (limits registry) over the profile's"
    )
    measured_limit_source: str | None = None
    backend: Backend = DEFAULT_BACKEND
    weights_residency: Literal["loaded", "mapped"] = "loaded"
    app: AppModel = "kvrig"
    generations: int = 1
    decode_tokens: int = 0


AUTO_WEIGHTS_NOTE = (
    f"Weights auto: planned as {WEIGHT_CANDIDATES[0]}, the first of {', '.join(WEIGHT_CANDIDATES)} that kvrig package "
    "--weights auto tries; packaging keeps the first whose bundle passes the quality gate, and a larger recipe holds "
    f"less context (--recipes {','.join(WEIGHT_CANDIDATES[1:])} lists their bytes)."
)


def plan_memory(spec: ModelSpec, profile: DeviceProfile, request: PlanRequest | None = None) -> MemoryPlan:
    """The memory plan of `spec` on `profile` for `request` (None: the planner's defaults). `backend` is where
    MLX runs the app: `metal` (the phone) or `cpu` (the host runtime, the virtual iPhone); they differ in the
    prefill transient (plan/transient.py)."""
    request = request or PlanRequest()
    auto_note = None
    if request.weights == AUTO:
        # the plan measures nothing: it counts the first recipe package's --weights auto tries, and says so
        request = request.model_copy(update={"weights": WEIGHT_CANDIDATES[0]})
        auto_note = AUTO_WEIGHTS_NOTE
    _check_request(request)
    # a KV spec's group size is its own (k8v4g32) or 64, as kvrig package writes it; never the weights' group
    kv_group = request.kv_group_size or DEFAULT_GROUP_SIZE
    parsed = _parsed_schemes(spec, request)
    for scheme in parsed.values():
        check_dims(spec, scheme)
    accounts, unavailable = _account_recipes(spec, request)
    if request.weights in unavailable:
        raise QuantizationError(
            f"weight recipe '{request.weights}' is unavailable for architecture '{spec.model_type}': "
            f"{unavailable[request.weights]}"
        )
    chosen = accounts[request.weights]
    trained = spec.config.get("text_config", spec.config).get("max_position_embeddings")
    cap = request.max_context_cap or (int(trained) if trained else 1 << 20)
    limit_kind, limit_bytes = _limits(profile, request.limit)
    if request.measured_limit_bytes is not None:  # what the phone said beats what the profile estimates
        if request.measured_limit_bytes > profile.ram_bytes.value:
            # a registry entry for another phone or a hand edit: no app is allowed more than the phone has
            raise PlanInputError(
                f"{request.measured_limit_source or 'the measured limit'}: limit_bytes {request.measured_limit_bytes}"
                " is more than the phone's RAM",
                expected=f"at most {profile.ram_bytes.value}, the RAM of {profile.name}",
            )
        limit_kind, limit_bytes = request.limit, request.measured_limit_bytes
    baseline = profile.baseline if request.baseline_bytes is None else request.baseline_bytes
    mapped = request.weights_residency == "mapped"
    # Mapped weights are clean file pages: iOS does not charge them to the footprint the jetsam limit judges.
    footprint_weights = 0 if mapped else chosen.total_bytes
    # An uncapped app's cache is replayed per context (_uncapped_budget), not a fixed term.
    cache_cap = request.buffer_cache_bytes if request.app == "kvrig" else 0
    fixed = footprint_weights + cache_cap + baseline
    uncapped = _Uncapped(spec, profile, request, footprint_weights, baseline) if request.app == "uncapped" else None

    max_context, limited_by = _solve(spec, parsed, request, limit_bytes, fixed, cap, uncapped)
    ceiling = profile.mapped_ceiling(limit_kind)
    if mapped and chosen.total_bytes > ceiling:
        max_context = dict.fromkeys(max_context, 0)
        limited_by = dict.fromkeys(limited_by, "mapped_ceiling")
    max_default = (
        _solve(spec, parsed, request, profile.limit_default, fixed, cap, uncapped)[0]
        if limit_kind == "entitled"
        else max_context
    )
    budgets = {
        name: uncapped.budget(scheme, max(max_context[name], 1))
        if uncapped is not None
        else _peak_bytes(
            spec, scheme, max(max_context[name], 1), fixed, request.prefill_step, request.dtype, request.backend
        ).model_copy(
            update={"weights_bytes": footprint_weights, "buffer_cache_bytes": cache_cap, "baseline_bytes": baseline}
        )
        for name, scheme in parsed.items()
    }
    all_limits, binding, gpu_check = _metal_limits(
        spec, profile, request, parsed, chosen, max_context, limited_by, budgets, cap
    )
    listed = sorted(set(request.contexts))
    bandwidth = profile.memory_bandwidth
    return MemoryPlan(
        model=ModelSummary(
            source=spec.source,
            model_type=spec.model_type,
            layers=spec.num_layers,
            parameters=chosen.parameters,
            layer_kinds={k: spec.count(k) for k in ("full", "sliding", "shared", "linear", "latent") if spec.count(k)},
            max_position_embeddings=int(trained) if trained else None,
            quantized_attention=spec.quantized_attention,
        ),
        device=DeviceSummary(
            name=profile.name,
            marketing_name=profile.marketing_name,
            product_types=list(profile.product_types),
            ram_bytes=profile.ram,
            ram_configurations_gb=profile.ram_sizes_gb,
            limit_default_bytes=profile.limit_default,
            limit_entitled_bytes=profile.limit_entitled,
            memory_bandwidth_bytes_per_s=bandwidth,
            page_size_bytes=profile.page_size,
            baseline_bytes=baseline,
        ),
        weights_recipe=request.weights,
        group_size=request.group_size,
        kv_group_size=kv_group,
        dtype=request.dtype,
        limit_kind=limit_kind,
        limit_requires=INCREASED_MEMORY_LIMIT if limit_kind == "entitled" else None,
        limit_bytes=limit_bytes,
        limit_measured_from=request.measured_limit_source if request.measured_limit_bytes is not None else None,
        margin=request.margin,
        budget_bytes=int(limit_bytes * (1 - request.margin)),
        weights_bytes=chosen.total_bytes,
        weights_by_recipe={name: a.total_bytes for name, a in accounts.items()},
        weights_unavailable=unavailable,
        active_weights_bytes=chosen.active_bytes,
        runtime=RuntimeTerms(
            app=request.app,
            generations=request.generations,
            decode_tokens=request.decode_tokens,
            buffer_cache_bytes=cache_cap,
            baseline_bytes=baseline,
            baseline_calibrated_from=request.baseline_source if request.baseline_bytes is not None else None,
            prefill_step=request.prefill_step,
            backend=request.backend,
            prefill_activation_bytes={
                str(c): prefill_activation_bytes(spec, request.prefill_step, c, request.dtype, backend=request.backend)
                for c in listed
            },
        ),
        kv_bytes_per_token={name: bytes_per_token(spec, s) for name, s in parsed.items()},
        kv_constant_bytes={name: constant_kv_bytes(spec, s, request.prefill_step) for name, s in parsed.items()},
        kv_bytes={
            name: {str(c): kv_bytes(spec, s, context_schedule(c, request.prefill_step)) for c in listed}
            for name, s in parsed.items()
        },
        max_context=max_context,
        max_context_default_limit=max_default,
        limited_by=limited_by,  # type: ignore[arg-type]
        budget_at_max_context=budgets,
        decode_tps_ceiling={
            name: {str(c): round(bandwidth / (chosen.active_bytes + kv_read_bytes(spec, s, c)), 1) for c in listed}
            for name, s in parsed.items()
        },
        recommendation=recommend(parsed, max_context, limited_by, chosen.parameters, request.target_context, spec),
        notes=[*([auto_note] if auto_note else []), *_notes(spec, profile, request, trained)],
        gpu_limits=GpuLimitsSummary(
            recommended_working_set_bytes=profile.gpu_working_set, max_buffer_bytes=profile.gpu_max_buffer
        ),
        gpu_check=gpu_check,
        max_context_all_limits=all_limits,
        binding_limit=binding,  # type: ignore[arg-type]
        weights_residency=request.weights_residency,
        mapped=_mapped_check(profile, limit_kind, chosen.total_bytes, budgets) if mapped else None,
        buffer_cache_by_context={
            name: {str(c): uncapped.budget(s, c).buffer_cache_bytes for c in listed} for name, s in parsed.items()
        }
        if uncapped is not None
        else {},
    )


class _Uncapped:
    """An uncapped app's budget at a context: MLX's allocator replayed over a run reaching it (allocator.py)."""

    def __init__(
        self, spec: ModelSpec, profile: DeviceProfile, request: PlanRequest, weights: int, baseline: int
    ) -> None:
        self.spec, self.request, self.weights, self.baseline = spec, request, weights, baseline
        self.policy = (
            AllocatorPolicy.phone(profile.page_size, profile.gpu_working_set, profile.ram)
            if request.backend == "metal"
            else AllocatorPolicy.host()
        )
        self._memo: dict[tuple[str, int], SchemeBudget] = {}

    def budget(self, scheme: KVSpec, context: int) -> SchemeBudget:
        key = (scheme.name, context)
        if key not in self._memo:
            r = self.request
            run = chat_run(context, r.generations, r.decode_tokens, r.prefill_step)
            last = trace_run(self.spec, scheme, run, dtype=r.dtype, policy=self.policy, base_bytes=self.weights)[-1]
            kv = kv_bytes_detail(self.spec, scheme, run[-1].updates).peak
            high, cache = last.high_bytes, last.high_cache_bytes
            self._memo[key] = SchemeBudget(
                context=context,
                weights_bytes=self.weights,
                kv_bytes=kv,
                kv_growth_copy_bytes=0,
                kv_dequantized_read_bytes=0,
                prefill_activation_bytes=max(0, high - self.weights - kv - cache),
                buffer_cache_bytes=cache,
                baseline_bytes=self.baseline,
                total_bytes=high + self.baseline,
            )
        return self._memo[key]

    def max_context(self, scheme: KVSpec, budget: int, estimate: int, cap: int) -> tuple[int, str]:
        best = largest_fitting(lambda c: self.budget(scheme, c).total_bytes <= budget, estimate, cap)
        if best == 0:
            return 0, "weights"
        return best, "model" if best == cap else "memory"


def _mapped_check(
    profile: DeviceProfile, limit_kind: str, weights: int, budgets: dict[str, SchemeBudget]
) -> MappedCheck:
    m = profile.mapped_memory_limit
    sourced = m.entitled_bytes if limit_kind == "entitled" and m.entitled_bytes is not None else m.default_bytes
    largest = max((b.total_bytes for b in budgets.values()), default=0)
    return MappedCheck(
        mapped_bytes=weights,
        ceiling_bytes=sourced.value,
        ceiling_basis=f"{sourced.basis}: {sourced.source}",
        within_ceiling=weights <= sourced.value,
        ram_bytes=profile.ram,
        ram_headroom_bytes=profile.ram - largest - weights,
    )


def _account_recipes(spec: ModelSpec, request: PlanRequest) -> tuple[dict[str, WeightsAccount], dict[str, str]]:
    """Weight bytes of every requested recipe (the chosen one first), and why the architecture cannot take the
    others: one recipe a model cannot take is listed, never the end of the plan. A name the grammar does not
    know is the caller's mistake and still an error."""
    recipes = {
        name: parse_weights(name, request.group_size) for name in dict.fromkeys([request.weights, *request.recipes])
    }
    accounts: dict[str, WeightsAccount] = {}
    unavailable: dict[str, str] = {}
    for name, recipe in recipes.items():
        try:
            accounts[name] = account_weights(spec, recipe, request.dtype)
        except QuantizationError as exc:
            unavailable[name] = str(exc)
    return accounts, unavailable


def _check_request(request: PlanRequest) -> None:
    for field, values in (
        ("contexts", request.contexts),
        ("prefill_step", (request.prefill_step,)),
        ("target_context", (request.target_context,) if request.target_context is not None else ()),
        ("max_context_cap", (request.max_context_cap,) if request.max_context_cap is not None else ()),
    ):
        if not all(1 <= v <= MAX_CONTEXT for v in values):
            raise PlanInputError(
                f"{', '.join(map(str, values))} is out of range", field=field, expected=f"1 to {MAX_CONTEXT} tokens"
            )
    if request.buffer_cache_bytes < 0:
        raise PlanInputError(f"{request.buffer_cache_bytes} bytes", field="buffer_cache_bytes", expected=">= 0")
    if not 0 <= request.margin < 1:
        raise PlanInputError(f"margin {request.margin} must be in [0, 1)", field="margin")
    if request.backend not in BACKENDS:
        raise PlanInputError(f"backend {request.backend!r}: expected one of {', '.join(BACKENDS)}", field="backend")
    if request.generations < 1:
        raise PlanInputError(f"generations {request.generations} must be at least 1", field="generations")
    if request.decode_tokens < 0:
        raise PlanInputError(f"decode tokens {request.decode_tokens} must be at least 0", field="decode_tokens")


def _solve(
    spec: ModelSpec,
    parsed: dict[str, KVSpec],
    request: PlanRequest,
    limit: int,
    fixed: int,
    cap: int,
    uncapped: _Uncapped | None = None,
) -> tuple[dict[str, int], dict[str, str]]:
    """Max context and what limits it, per scheme, under `limit` less the margin."""
    budget = int(limit * (1 - request.margin))
    max_context: dict[str, int] = {}
    limited_by: dict[str, str] = {}
    for name, scheme in parsed.items():
        max_context[name], limited_by[name] = max_context_for(
            spec, scheme, budget, fixed, request.prefill_step, request.dtype, cap, request.backend
        )
        if uncapped is not None:
            # The capped answer bounds the search from above: the replayed cache only adds to it.
            estimate = max(1, max_context[name])
            max_context[name], limited_by[name] = uncapped.max_context(scheme, budget, estimate, cap)
    return max_context, limited_by


def _metal_limits(
    spec: ModelSpec,
    profile: DeviceProfile,
    request: PlanRequest,
    parsed: dict[str, KVSpec],
    chosen: WeightsAccount,
    max_context: dict[str, int],
    limited_by: dict[str, str],
    budgets: dict[str, SchemeBudget],
    cap: int,
) -> tuple[dict[str, int], dict[str, str], dict[str, GpuCheck]]:
    """Metal's own limits beside jetsam's: the GPU-resident total (no app baseline) within the recommended
    working set, and the largest single array within the largest buffer. Per scheme: the max context under all
    limits, the limit that binds, and the check at the jetsam max context."""
    working_set, max_buffer = profile.gpu_working_set, profile.gpu_max_buffer
    step, dtype, backend = request.prefill_step, request.dtype, request.backend
    weights_array = chosen.largest_array
    # An uncapped cache never passes the working set on its own: Metal empties it first (allocator.py).
    gpu_fixed = chosen.total_bytes + (request.buffer_cache_bytes if request.app == "kvrig" else 0)
    all_limits: dict[str, int] = {}
    binding: dict[str, str] = {}
    gpu_check: dict[str, GpuCheck] = {}
    for name, scheme in parsed.items():
        options: list[tuple[int, str]] = [(max_context[name], "jetsam")]
        if working_set is not None:
            ws_budget = int(working_set * (1 - request.margin))
            ws_context = max_context_for(spec, scheme, ws_budget, gpu_fixed, step, dtype, cap, backend)[0]
            options.append((ws_context, "metal_working_set"))
        if max_buffer is not None:
            buffer_context = max_context_for_buffer(spec, scheme, max_buffer, step, dtype, weights_array, cap, backend)
            options.append((buffer_context, "metal_max_buffer"))
        best, which = min(options, key=lambda o: o[0])  # ties keep jetsam (listed first)
        if which == "jetsam" and limited_by[name] in ("model", "weights", "mapped_ceiling"):
            which = limited_by[name]
        elif best == 0:
            which = "weights" if which == "jetsam" else which
        all_limits[name], binding[name] = best, which
        ctx = max(max_context[name], 1)
        b = budgets[name]
        resident = b.total_bytes - b.baseline_bytes
        size, what = _largest_buffer(spec, scheme, ctx, step, dtype, weights_array, backend)
        gpu_check[name] = GpuCheck(
            context=ctx,
            resident_bytes=resident,
            largest_buffer_bytes=size,
            largest_buffer=what,
            within_working_set=None if working_set is None else resident <= working_set,
            within_max_buffer=None if max_buffer is None else size <= max_buffer,
        )
    return all_limits, binding, gpu_check


def _notes(spec: ModelSpec, profile: DeviceProfile, request: PlanRequest, trained: Any) -> list[str]:
    notes = list(spec.notes)
    exact = (
        "Weights and KV bytes are exact (MLX's own nbytes); prefill activations besides the attention scores, "
        "the baseline and the decode ceiling are estimates."
    )
    if request.baseline_bytes is None:
        notes.append(f"{exact} The baseline comes from the device profile.")
    else:
        source_text = f" ({request.baseline_source})" if request.baseline_source else ""
        notes.append(
            f"{exact} The baseline is calibrated from measured soaks{source_text}; the profile's estimate is "
            f"{profile.baseline} bytes."
        )
    notes.append(
        f"Backend {request.backend} ({BACKENDS[request.backend]}): the prefill transient's attention scores are "
        "counted as MLX's attention holds them there (buffers per score measured on this host's MLX)."
    )
    if request.weights_residency == "mapped":
        notes.append(
            "Weights mapped from the bundle's file (kvrig package --weights-layout mapped): iOS charges the footprint "
            "for dirty, anonymous memory, not for clean pages mapped read-only, so the weights are left out of the "
            "jetsam budget and counted against the mapped-memory ceiling, Metal's working set and the phone's RAM "
            "(llama.cpp maps its weights this way on iOS; ExecuTorch measured ~400 MB of mapped weights leaving "
            "phys_footprint, pytorch/executorch#19862). Uncertain until measured on a phone: that MLX Swift's "
            "no-copy buffers (mlx_array_new_data_managed) stay clean on Metal, and the ceiling on this device "
            "(one public measurement, on an iPhone 13). `kvrig lab` runs a bundle loaded and mapped side by side "
            "and `kvrig calibrate` corrects the plan from it."
        )
    attention = _attention_note(spec, request)
    if attention:
        notes.append(attention)
    if spec.model_type in APP_UNQUANTIZED_KV and any(parse_kv(n).quantized for n in request.schemes):
        notes.append(
            f"{spec.model_type}: the MLX Swift app keeps this family's KV unquantized (its KV-shared layers read "
            "their owner's cache as float keys and values), so only the fp16 rows hold for kvrig's app; kvrig "
            "package writes fp16 KV for it."
        )
    for scheme in (parse_kv(n) for n in request.schemes):
        if scheme.promote_keys is None:
            continue
        bits, count = scheme.promote_keys
        notes.append(
            f"{scheme.name}: kvrig package measures which {count} layers' keys suffer most; the plan counts keys at "
            f"{bits} bits in the {count} layers where that costs the most"
            + (
                " (exact here: every quantized layer's keys take the same bytes)."
                if promotion_is_exact(spec, scheme)
                else " (an upper bound: this model's layers differ)."
            )
        )
    if request.app == "uncapped":
        notes.append(_UNCAPPED_NOTE.format(g=request.generations, d=request.decode_tokens, b=request.backend))
    if trained is None:
        notes.append("config has no max_position_embeddings; max context is bounded by memory only.")
    return notes


def _parsed_schemes(spec: ModelSpec, request: PlanRequest) -> dict[str, KVSpec]:
    """The request's KV specs by the name the user gave them, `+kN@topM` counted at its costliest layers."""
    group = request.kv_group_size or DEFAULT_GROUP_SIZE
    parsed = (parse_kv(n, group_size=group, dtype=request.dtype) for n in request.schemes)
    return {s.name: promoted_for_bytes(spec, s) for s in parsed}


def _attention_note(spec: ModelSpec, request: PlanRequest) -> str | None:
    """Why a scheme with K and V at one width (k4v4) can hold a larger prefill transient than a mixed one (k8v4):
    which attention each cache meets (planner/transient.py), with this plan's numbers at its largest context."""
    parsed = _parsed_schemes(spec, request)
    equal = [name for name, s in parsed.items() if s.quantized and not dequantizes_on_read(s, spec)]
    if not equal:
        return None
    context = max(request.contexts)
    step = request.prefill_step
    scores = {
        name: prefill_scores_bytes(spec, step, context, request.dtype, scheme=s, backend=request.backend)
        for name, s in parsed.items()
    }
    shown = ", ".join(f"{name} {human_mib(b)}" for name, b in scores.items())
    mixed = {name: s for name, s in parsed.items() if dequantizes_on_read(s, spec)}
    names = ", ".join(mixed)
    if not mixed:
        mixed_text = ""
    elif request.backend == "cpu":
        mixed_text = (
            f"; on this host {names} (K and V at their own widths) go through kvrig's scheme cache, counted as "
            "mlx-lm's quantized attention at the key width plus one dequantized layer"
        )
    else:
        deq = ", ".join(human_mib(dequantized_read_bytes(spec, s, context, request.backend)) for s in mixed.values())
        mixed_text = (
            f"; {names} (K and V at their own widths) are dequantized one layer at a time ({deq} at {context} "
            "tokens) for MLX's attention, fused on Metal for head dims 64/80/128"
        )
    return (
        f"Prefill transient by attention path: {', '.join(equal)} (K and V at one width) run mlx-lm's "
        "quantized attention, unfused on every backend, so each prefill chunk holds heads x chunk x context scores"
        f"{mixed_text}. Attention buffers of a {step}-token chunk at {context} tokens on {request.backend}: {shown} "
        "(buffers per score measured on MLX's own attention on this host; "
        "tests/plan/test_transient_qwen3_4b.py). A smaller cache can need more memory in total at long contexts."
    )


def human_mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


_UNCAPPED_NOTE = (
    "App model uncapped: an app that never sets Memory.cacheLimit keeps MLX's default cap, its memory limit. "
    "MLX keeps every freed buffer and hands it out again only for a request of nearly its size, so what a "
    "growing context frees stays cached: each KV growth step's old buffers, each prefill chunk's attention "
    "buffers (their size grows with the context), the activations of each chunk length. The plan replays MLX's "
    "allocator on {b} over {g} generation(s) in a row whose context grows evenly to each context, each decoding "
    "{d} token(s) (--generations, --decode-tokens), and counts the highest active + cached bytes; on Metal the "
    "cache is emptied, oldest first, once active + cached bytes would pass 0.95 x the recommended working set. "
    "MLX Swift's released generation loop (mlx-swift-lm 3.31) never empties the cache (its main branch does "
    "every 256 decoded tokens); mlx-lm's Python loop after every prefill chunk and every 256 tokens. "
    "mlx-swift-examples' apps cap it at 20 MB "
    "(LLMEval, MLXChatExample): plan such an app with --app kvrig --buffer-cache-mib 20."
)


def constant_kv_bytes(spec: ModelSpec, scheme: KVSpec, prefill_step: int) -> int:
    """Rings and recurrent state at full size: their bytes once the context passes every window."""
    windows = [layer.window or 1 for layer in spec.layers if layer.kind in ("sliding", "linear")]
    if not windows:
        return 0
    return kv_bytes(spec, scheme, context_schedule(max(windows) + 1, prefill_step), kinds=("sliding", "linear"))
