"""Issue 23: the k4v4-vs-k8v4 prefill transient, measured on this host at Qwen3-4B's attention shapes (32 query
heads, 8 KV heads, head dim 128) and held to the plan.

Each scheme's cache is the one the runtime builds from kvcache.json (`make_caches`): k4v4 is mlx-lm's
QuantizedKVCache read by mlx-lm's quantized attention, k8v4 is kvrig's scheme cache (K and V at their own widths).
The expected bytes are MLX's own peak memory while a prefill chunk runs, in a fresh interpreter with OpenBLAS
preloaded, as the host runtime runs (the scheme cache's matmuls hold other buffers under MLX's reference BLAS).
On the phone (Metal) the k8v4 path dequantizes one layer for MLX's fused attention instead, which this host
cannot run; the plan's Metal numbers for Qwen3-4B's published config are checked against arithmetic on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrig.models import load_model_spec
from kvrig.planner import plan
from kvrig.planner.runtime import prefill_scores_bytes
from kvrig.recipes import parse_kv

ROOT = Path(__file__).resolve().parents[2]
QWEN3_4B = ROOT / "tests" / "data" / "field" / "configs" / "qwen3-4b.json"
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-4B's attention (its published config)
CONTEXT, CHUNK = 1024, 256  # 32 MiB of float32 scores per layer: the attention dominates the chunk
ATTENTION_TOLERANCE = 0.10  # the attention buffers alone: the plan 1.5-2 % above MLX's peak when measured
CHUNK_TOLERANCE = 0.20  # the whole chunk, whose other activations are estimates: measured k4v4 1.00, k8v4 1.12


def _measure(scheme: str) -> dict[str, int]:
    """In this interpreter: a 2-layer qwen3 with Qwen3-4B's attention shapes, random weights, float32, caches from
    kvcache.json; MLX's peak for (a) one layer's attention over a CONTEXT-token cache as the model calls it and
    (b) the chunk from CONTEXT - CHUNK to CONTEXT through the whole model (caches evaluated, logits never)."""
    import mlx.core as mx
    from mlx_lm.models import base

    from kvrig.compat.mlx_lm_classes import model_classes
    from kvrig.kvcache.caches import make_caches
    from kvrig.kvcache.kv_cache import SchemeKVCache
    from kvrig.models import spec_from_config
    from kvrig.planner.kv import kv_bytes
    from kvrig.planner.memory import _peak_bytes
    from kvrig.schemas.kvcache import LayerCache, host_kvcache
    from tests.plan.tiny_configs import TINY_CONFIGS

    parsed = parse_kv(scheme, dtype="float32")
    config = {
        **TINY_CONFIGS["qwen3"],
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 2,
    }
    layers = [
        LayerCache(layer=i, kind="full", key_bits=parsed.key_bits, value_bits=parsed.value_bits) for i in range(2)
    ]
    kv = host_kvcache(
        layers,
        max_context=CONTEXT,
        prefill_step_size=CHUNK,
        scheme=scheme,
        key_bits=parsed.key_bits,
        value_bits=parsed.value_bits,
        dtype="float32",
    )

    def peak(run) -> int:  # type: ignore[no-untyped-def]
        mx.synchronize()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        run()
        return int(mx.get_peak_memory() - before)

    # (a) the attention alone, through the cache the runtime builds
    mx.random.seed(0)
    q = mx.random.normal((1, HEADS, CHUNK, HEAD_DIM))
    k, v = (mx.random.normal((1, KV_HEADS, CONTEXT, HEAD_DIM)) for _ in range(2))
    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    (cache, *_) = make_caches(model, kv, "qwen3")
    keys, values = cache.update_and_fetch(k, v)
    mx.eval(q, cache.state)
    if isinstance(cache, SchemeKVCache):
        attend = lambda: cache.attention(q, HEAD_DIM**-0.5, "causal")  # noqa: E731
    else:
        attend = lambda: base.scaled_dot_product_attention(  # noqa: E731
            q, keys, values, cache=cache, scale=HEAD_DIM**-0.5, mask="causal"
        )
    mx.eval(attend())  # once unmeasured (kernel set-up)
    # the largest of three: now and then MLX frees a buffer early and the peak reads lower (never higher)
    attention = max(peak(lambda: mx.eval(attend())) for _ in range(3))
    path = type(cache).__name__

    # (b) the whole chunk
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())

    def fresh_chunk() -> int:
        caches = make_caches(model, kv, "qwen3")
        for c in caches:  # the context before the chunk, in one update (a model pass per chunk is slow here)
            c.update_and_fetch(*(mx.random.normal((1, KV_HEADS, CONTEXT - CHUNK, HEAD_DIM)) for _ in range(2)))
        mx.eval([c.state for c in caches])

        def run_chunk() -> None:  # as mlx-lm's generate_step runs a chunk: the caches evaluated, the logits never
            model(mx.ones((1, CHUNK), mx.int32), cache=caches)
            mx.eval([c.state for c in caches])

        return peak(run_chunk)

    chunk = max(fresh_chunk() for _ in range(2))  # on new caches each time, the larger (as above)
    spec = spec_from_config(config)
    before = kv_bytes(spec, parsed, [CONTEXT - CHUNK])
    # the plan's chunk at CONTEXT (its caches grown as the one update above and the chunk grow them)
    planned_chunk = _peak_bytes(spec, parsed, CONTEXT, 0, CHUNK, "float32", "cpu").total_bytes - before
    planned_attention = prefill_scores_bytes(spec, CHUNK, CONTEXT, "float32", scheme=parsed, backend="cpu")
    return {
        "path": path,  # type: ignore[dict-item]
        "attention": attention,
        "planned_attention": planned_attention,
        "chunk": chunk,
        "planned_chunk": planned_chunk,
    }


def _fresh(scheme: str) -> dict:
    code = (
        "import json, sys; sys.path[:0] = ['.']; "
        f"from tests.plan.test_transient_qwen3_4b import _measure; print(json.dumps(_measure({scheme!r})))"
    )
    from kvrig.runtime.blas import find_openblas

    lib = find_openblas()
    env = {**os.environ, **({"LD_PRELOAD": lib} if lib else {})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("scheme", "path"), [("k4v4", "QuantizedKVCache"), ("k8v4", "SchemeKVCache")])
def test_host_transient_follows_mlx_at_qwen3_4b_shapes(scheme: str, path: str) -> None:
    case = _fresh(scheme)
    assert case["path"] == path  # each scheme's own attention path, as the runtime builds it
    measured, planned = case["attention"], case["planned_attention"]
    if path == "QuantizedKVCache":
        assert abs(planned - measured) <= ATTENTION_TOLERANCE * measured, case
    # kvrig's scheme cache (k8v4) is planned as mlx-lm's quantized attention at the key width plus one
    # dequantized layer, outside the attention term: a probe of that cache's own graph read from 0.03 to 1.28
    # buffers per score from one fresh process to the next, so only the whole chunk is held to MLX's peak.
    assert abs(case["planned_chunk"] - case["chunk"]) <= CHUNK_TOLERANCE * case["chunk"], case
    # the attention is most of the chunk (so the chunk check is about the attention path)
    assert measured > 0.55 * case["chunk"], case


def test_phone_plan_k4v4_holds_scores_k8v4_a_dequantized_layer() -> None:
    """On the phone (Metal) at 8192 tokens, Qwen3-4B's published config: k4v4's chunk materializes 32 x 512 x 8192
    scores, k8v4's dequantizes one layer for the fused kernel (2 x 8 x 8192 x 128 float16) and holds no scores."""
    cfg = json.loads(QWEN3_4B.read_text())
    heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    spec = load_model_spec(QWEN3_4B)
    k4v4, k8v4 = parse_kv("k4v4"), parse_kv("k8v4")
    scores = heads * 512 * 8192 * 2
    assert scores <= prefill_scores_bytes(spec, 512, 8192, scheme=k4v4, backend="metal") <= 1.1 * scores
    assert prefill_scores_bytes(spec, 512, 8192, scheme=k8v4, backend="metal") == 0
    p = plan(QWEN3_4B, "iPhone16,1", schemes=["k4v4", "k8v4"], contexts=[8192], max_context_cap=8192)
    b4, b8 = p.budget_at_max_context["k4v4"], p.budget_at_max_context["k8v4"]
    assert b8.kv_dequantized_read_bytes == 2 * kv_heads * 8192 * dim * 2
    transient4 = b4.prefill_activation_bytes + b4.kv_growth_copy_bytes + b4.kv_dequantized_read_bytes
    transient8 = b8.prefill_activation_bytes + b8.kv_growth_copy_bytes + b8.kv_dequantized_read_bytes
    assert b4.kv_bytes < b8.kv_bytes and transient4 > transient8 + scores // 2
    (note,) = [n for n in p.notes if n.startswith("Prefill transient by attention path")]
    assert "k4v4" in note and "k8v4" in note and "dequantized one layer at a time" in note
