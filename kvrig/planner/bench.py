"""`kvrig bench plan`: how fast planning is and how little it allocates, side by side with doing it for real.

Planning asks MLX about arrays it never evaluates, so the bytes it allocates are MLX's peak memory during the
plan (graph bookkeeping only) and Python's own (tracemalloc). The same KV answer is then produced for real
(evaluated caches) to show the ratio, and one prefill chunk runs on the real model to measure the transient
the plan estimates (CPU, float32), beside the plan's for the CPU backend and for Metal, where the fused attention kernel
does not materialize the scores for head dims 64, 80 and 128 (the phone keeps activations in float16, half
these widths).
"""

from __future__ import annotations

import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvrig.models import load_model_spec
from kvrig.models.lazy import cast_model
from kvrig.models.probe import forget_replays
from kvrig.planner.kv import context_schedule, kv_bytes
from kvrig.planner.memory import PlanRequest, plan_memory
from kvrig.planner.runtime import prefill_activation_bytes
from kvrig.profiles import load_profile
from kvrig.recipes import parse_kv

BENCH_CONTEXT = 8192


@dataclass
class PlanBench:
    model: str
    plan_seconds: float
    plan_mlx_peak_bytes: int
    plan_python_peak_bytes: int
    kv_context: int
    kv_bytes_lazy: int
    kv_lazy_seconds: float
    kv_lazy_mlx_peak_bytes: int
    kv_bytes_evaluated: int | None
    kv_evaluated_mlx_peak_bytes: int | None
    transient_context: int | None
    transient_measured_bytes: int | None
    transient_planned_bytes: int | None
    """for the CPU backend, where the measurement runs"""
    transient_planned_metal_bytes: int | None = None
    """for the phone (Metal): what the plan counts there for the same chunk"""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _measure(fn: Any) -> tuple[Any, float, int, int]:
    import mlx.core as mx

    mx.clear_cache()
    mx.reset_peak_memory()
    tracemalloc.start()
    began = time.perf_counter()
    try:
        out = fn()
        seconds = time.perf_counter() - began
        py_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out, seconds, mx.get_peak_memory(), py_peak


def benchmark_plan(model: str | Path | None, device: str, *, real: bool = True, prefill_step: int = 512) -> PlanBench:
    """Time and allocation of a whole plan and of one KV answer; with `real`, the same KV evaluated and one
    prefill chunk measured on the real model (small models only: it allocates them)."""
    import mlx.core as mx

    spec = load_model_spec(model)
    profile = load_profile(device)
    _, plan_s, plan_mlx, plan_py = _measure(lambda: plan_memory(spec, profile, PlanRequest(prefill_step=prefill_step)))
    fp16 = parse_kv("fp16")
    schedule = context_schedule(BENCH_CONTEXT, prefill_step)
    fresh = load_model_spec(model)
    fresh.probe()
    forget_replays()  # answer from scratch, not from what the plan above remembered
    lazy, kv_s, kv_mlx, _ = _measure(lambda: kv_bytes(fresh, fp16, schedule))
    result = PlanBench(
        str(spec.source), plan_s, plan_mlx, plan_py, BENCH_CONTEXT, lazy, kv_s, kv_mlx, None, None, None, None, None
    )
    if not real:
        return result

    from mlx_lm.models.cache import make_prompt_cache

    def evaluated() -> int:
        caches = make_prompt_cache(spec.probe().model)
        probe = spec.probe()
        for n in schedule:
            for slot, cache in zip(probe.slots, caches, strict=False):
                for update in slot.updates:
                    cache.update_and_fetch(*update.arrays(n))
            mx.eval([c.state for c in caches])
        return sum(c.nbytes for c in caches)

    real_kv, _, real_mlx, _ = _measure(evaluated)
    result.kv_bytes_evaluated, result.kv_evaluated_mlx_peak_bytes = real_kv, real_mlx

    # The prefill transient, measured as mlx-lm's generate_step runs a chunk (caches evaluated, the chunk's
    # logits never): one chunk of `prefill_step` tokens at a context of 2048, on the real model in float32 on
    # the CPU, MLX's peak minus what was resident before and minus what the caches grew by (the plan counts KV
    # on its own). Planned for the same chunk on the CPU backend (what the host and the virtual iPhone run)
    # and on Metal (the phone).
    context = 2048
    net = cast_model(spec.lazy_model(), "float32")
    mx.eval(net.parameters())
    caches = make_prompt_cache(net)
    net(mx.zeros((1, context - prefill_step), mx.int32), cache=caches)
    mx.eval([c.state for c in caches])
    mx.clear_cache()
    resident, kv_before = mx.get_active_memory(), sum(c.nbytes for c in caches)
    mx.reset_peak_memory()
    net(mx.ones((1, prefill_step), mx.int32), cache=caches)
    mx.eval([c.state for c in caches])
    grown = sum(c.nbytes for c in caches) - kv_before
    result.transient_context = context
    result.transient_measured_bytes = mx.get_peak_memory() - resident - grown
    result.transient_planned_bytes = prefill_activation_bytes(spec, prefill_step, context, "float32", backend="cpu")
    result.transient_planned_metal_bytes = prefill_activation_bytes(
        spec, prefill_step, context, "float32", backend="metal"
    )
    return result
