"""The planner's KV bytes (mlx-lm's caches driven lazily) equal MLX's `nbytes` after real updates.

For families with distinct layer patterns a tiny model runs real, evaluated tokens through each cache kind
and KV scheme (the caches kvrig's runtime makes); after every update — step boundaries, ragged growth and
sliding wrap-around included — the planned bytes must equal what MLX allocated, byte for byte.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest
from tiny_configs import TINY_CONFIGS

from kvrig.compat.mlx_lm_classes import model_classes
from kvrig.exceptions import QuantizationError
from kvrig.models import spec_from_config
from kvrig.planner.kv import bytes_per_token, check_dims, kv_bytes, kv_bytes_detail
from kvrig.quality.schemes import make_kv_caches
from kvrig.recipes import parse_kv

# The phone keeps activations (and so caches) in fp16; a few families run that way here. The rest run in
# fp32 because MLX's CPU matmul is far faster there (and its GatherMM for MoE experts is fp32-only); the
# planner is then asked for fp32 caches, which exercises the same accounting with another width.
FP16_FAMILIES = {"llama", "llama-sliding", "gemma3_text", "qwen3_5", "gemma2"}
# Quantized caches at fp16 run MLX's float16 quantized attention, emulated on x86 (~9 s a case where fp32 takes
# 0.5 s): llama carries that width for one scheme of each cache kind (mlx-lm's k8v8, kvrig's mixed-bit k8v4 and
# k4v8); its other schemes and the other families' quantized caches run at fp32.
FP16_QUANTIZED = {("llama", "k8v8"), ("llama", "k8v4"), ("llama", "k4v8")}

# Single tokens first (sliding caches grow in place and wrap past their window of 8), then chunks that land
# on 256, just past it, and cross 512 from a ragged offset (299 + 214: MLX trims to 299 and adds a step).
SCHEDULE = [1] * 12 + [100, 144, 1, 1, 40, 1, 214, 1, 2]

# Every family under the three kinds of cache (plain, mlx-lm quantized, kvrig's mixed-bit); the other
# schemes on one family per layer pattern.
CASES = [(family, scheme) for family in sorted(TINY_CONFIGS) for scheme in ("fp16", "k8v8", "k8v4")] + [
    (family, scheme)
    for family in ("llama", "gemma3_text", "qwen3_next")
    for scheme in ("k4v8", "k4v4", "k6v4g32", "bf16")
]


@functools.cache
def build(name: str, quantized: bool = False, fp16_quantized: bool = False):
    config = TINY_CONFIGS[name]
    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    fp16 = name in FP16_FAMILIES and (not quantized or fp16_quantized)
    dtype = "float16" if fp16 else "float32"
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, spec_from_config(config), dtype


@pytest.mark.parametrize(("family", "scheme_name"), CASES)
def test_planned_kv_bytes_equal_mlx_nbytes(family: str, scheme_name: str) -> None:
    quantized = scheme_name not in ("fp16", "bf16")
    model, spec, dtype = build(family, quantized, (family, scheme_name) in FP16_QUANTIZED)
    if scheme_name in ("fp16", "bf16") and dtype == "float32":
        scheme_name = "fp32"  # unquantized caches hold the activation dtype
    if scheme_name == "bf16":
        model.set_dtype(mx.bfloat16)
        dtype = "bfloat16"
    scheme = parse_kv(scheme_name, dtype=dtype)
    try:
        check_dims(spec, scheme)
    except QuantizationError:  # MLA's rope key (32 wide) needs a smaller group, as the planner says
        scheme = parse_kv(scheme_name, group_size=32, dtype=dtype)
    caches = make_kv_caches(model, spec, scheme)
    fed: list[int] = []
    token = 1
    for n in SCHEDULE:
        tokens = mx.array([[(token + i) % 100 + 1 for i in range(n)]])
        token += n
        mx.eval(model(tokens, cache=caches))
        fed.append(n)
        measured = sum(c.nbytes for c in caches)
        planned = kv_bytes(spec, scheme, fed)
        assert planned == measured, f"{family} {scheme_name} after {sum(fed)} tokens (updates {fed[-3:]})"


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_bytes_per_token_is_the_growth_of_full_caches(family: str) -> None:
    """Steady-state bytes/token: the difference MLX shows between two step-aligned contexts, per token."""
    model, spec, dtype = build(family)
    scheme = parse_kv("k8v4", group_size=32, dtype=dtype)
    caches = make_kv_caches(model, spec, scheme)
    owners = [layer for layer in spec.layers if layer.kind != "shared"]
    growing = [c for layer, c in zip(owners, caches, strict=True) if layer.grows]

    def growing_bytes() -> int:
        return sum(c.nbytes for c in growing)

    mx.eval(model(mx.array([list(range(1, 257))]), cache=caches))
    at_256 = growing_bytes()
    mx.eval(model(mx.array([list(range(1, 257))]), cache=caches))
    assert bytes_per_token(spec, scheme) * 256 == growing_bytes() - at_256


@pytest.mark.parametrize("scheme_name", ["fp32", "k8v8", "k8v4"])
def test_llama4_chunked_caches_trim_as_planned(scheme_name: str) -> None:
    """llama4 trims its chunked caches' front before each step (a call the planner learns from the model's own
    step and replays); they stay unquantized under every scheme, its global layer's plain cache does not."""
    from arch_configs import tiny_config

    config = tiny_config("llama4")
    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    mx.eval(model.parameters())
    spec = spec_from_config(config)
    scheme = parse_kv(scheme_name, dtype="float32")
    caches = make_kv_caches(model, spec, scheme)
    chunk = config["text_config"]["attention_chunk_size"]
    assert [layer.quantizable for layer in spec.layers] == [False, False, False, True]
    fed: list[int] = []
    for n in SCHEDULE:
        mx.eval(model(mx.array([[(sum(fed) + i) % 100 + 1 for i in range(n)]]), cache=caches))
        fed.append(n)
        assert kv_bytes(spec, scheme, fed) == sum(c.nbytes for c in caches), f"{scheme_name} after {sum(fed)}"
    assert sum(fed) > 2 * chunk  # the chunked caches were trimmed more than once


@pytest.mark.parametrize(
    ("family", "scheme_name"),
    [("llama", "fp32"), ("llama", "k4v4"), ("llama", "k8v4+rot+s4+w16"), ("gemma3_text", "k8v8")],
)
def test_replays_resumed_midway_equal_mlx_nbytes(family: str, scheme_name: str) -> None:
    """The planner resumes a replay from a cache it kept part-way through an earlier one (every
    probe.CHECKPOINT_EVERY updates of a schedule's leading run): asked in a search's order — a long schedule, then
    shorter ones that resume from its checkpoints — its bytes equal MLX's `nbytes` of the caches the host runtime
    makes for the scheme, fed the same chunks of real tokens (plain, mlx-lm's quantized, kvrig's rotated with sink
    and window, and a model with sliding-window layers)."""
    from kvrig.models.probe import CHECKPOINT_EVERY, forget_replays

    model, spec, dtype = build(family, quantized=True)  # float32: fast here, and the caches' width
    scheme = parse_kv(scheme_name, dtype=dtype)
    forget_replays()
    chunk, tail = 64, 23
    for runs in (2 * CHECKPOINT_EVERY + 8, CHECKPOINT_EVERY + 4, 2 * CHECKPOINT_EVERY + 5, CHECKPOINT_EVERY + 1, 3):
        schedule = [chunk] * runs + [tail]
        caches = make_kv_caches(model, spec, scheme)
        peak = 0
        for n in schedule:
            mx.eval(model(mx.array([[i % 100 + 1 for i in range(n)]]), cache=caches))
            peak = max(peak, sum(c.nbytes for c in caches))
        planned = kv_bytes_detail(spec, scheme, schedule)
        assert planned.total == sum(c.nbytes for c in caches), runs
        # A sliding cache peaks mid-schedule, the others at the end: the plan's peak is their sum's.
        assert planned.peak == peak, runs
