"""kvrig's KV schemes: quantization error per bit width, the rotation keeping attention unchanged, cache bytes
equal to the plan, and clear errors for schemes that cannot be applied. Tiny mlx-lm models built from
arguments; expected values from MLX itself (nbytes, mx.fast.scaled_dot_product_attention) or from the data."""

from __future__ import annotations

import math
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from kvrig.bundle.kvcache_json import host_config
from kvrig.exceptions import KVSchemeError, QuantizationError
from kvrig.kvcache.caches import make_caches
from kvrig.kvcache.kv_cache import DEQUANTIZED_ROWS, SchemeKVCache, rotate
from kvrig.models import spec_from_config
from kvrig.planner.kv import kv_bytes
from kvrig.quality.schemes import make_kv_caches
from kvrig.recipes import parse_kv

CONFIG = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 97,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def tiny(**overrides: object) -> tuple[llama.Model, object]:
    config = {**CONFIG, **overrides}
    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, spec_from_config(config)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_stored_rows_are_within_one_quantization_step(bits: int) -> None:
    """Affine quantization per group of 64: every value comes back within one step, (max-min)/(2^bits-1), of its
    group's own range (MLX fits scale and bias so the error can exceed half a step, never a whole one)."""
    mx.random.seed(bits)
    keys = mx.random.normal((1, 2, 40, 64)) * 3.0
    cache = SchemeKVCache(bits, bits, 64)
    cache.update_and_fetch(keys, keys)
    assert cache.keys is not None
    w, s, b = (x[..., :40, :] for x in cache.keys)
    back = np.array(mx.dequantize(w, s, b, group_size=64, bits=bits))
    data = np.array(keys)
    step = (data.max(-1, keepdims=True) - data.min(-1, keepdims=True)) / (2**bits - 1)
    err = np.abs(back - data)
    assert (err <= step + 1e-4).all()
    # and the bound is tight enough to mean something: the error is a real fraction of a step
    assert err.max() > step.min() / 8


def test_rotation_leaves_attention_scores_unchanged() -> None:
    mx.random.seed(0)
    q, k = mx.random.normal((1, 2, 5, 64)), mx.random.normal((1, 2, 9, 64))
    plain = q @ k.swapaxes(-1, -2)
    rotated = rotate(q) @ rotate(k).swapaxes(-1, -2)
    np.testing.assert_allclose(np.array(rotated), np.array(plain), atol=1e-4)
    # the transform really moves the vectors (not the identity) and is its own inverse
    assert float(mx.abs(rotate(k) - k).max()) > 0.1
    np.testing.assert_allclose(np.array(rotate(rotate(k))), np.array(k), atol=1e-5)


@pytest.mark.parametrize("rotation", ["none", "hadamard_keys", "hadamard"])
def test_cache_attention_equals_mlx_attention_when_nothing_is_quantized_away(rotation: str) -> None:
    """With sinks and the recent window covering every token, the scheme cache reads only float copies: its
    attention (rotated queries, un-rotated outputs) must equal MLX's fused attention on the raw tensors, for a
    causal prefill chunk and then single decode steps (GQA: 6 query heads on 2 KV heads)."""
    mx.random.seed(1)
    q, k, v = (mx.random.normal((1, h, 40, 64)) for h in (6, 2, 2))
    scale = 64**-0.5
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    cache = SchemeKVCache(4, 4, 64, rotation=rotation, sink_tokens=8, recent_tokens=32)
    cache.update_and_fetch(k[..., :30, :], v[..., :30, :])
    out = cache.attention(q[..., :30, :], scale, "causal")
    np.testing.assert_allclose(np.array(out), np.array(ref[..., :30, :]), atol=2e-5)
    for t in range(30, 40):
        cache.update_and_fetch(k[..., t : t + 1, :], v[..., t : t + 1, :])
        out = cache.attention(q[..., t : t + 1, :], scale, None)
        np.testing.assert_allclose(np.array(out), np.array(ref[..., t : t + 1, :]), atol=2e-5)


@pytest.mark.parametrize("name", ["k5v3", "k8v4+rot+s4+w8"])
def test_prefill_rows_read_the_same_quantized_cache_as_decode_rows(name: str) -> None:
    """Many query rows read dequantized copies through a float matmul, a single row reads the packed cache
    through MLX's quantized matmul: both give the same attention, and without extras it is MLX's fused
    attention over MLX's own dequantization of the stored rows."""
    mx.random.seed(3)
    variant = parse_kv(name)
    s = variant
    assert s.key_bits is not None and s.value_bits is not None
    q, k, v = (mx.random.normal((1, h, n, 64)) for h, n in ((6, 24), (2, 100), (2, 100)))
    scale = 64**-0.5
    extras = {"rotation": variant.rotation, "sink_tokens": variant.sink_tokens, "recent_tokens": variant.recent_tokens}
    cache = SchemeKVCache(s.key_bits, s.value_bits, s.group_size, **extras)  # type: ignore[arg-type]
    cache.update_and_fetch(k, v)
    assert 3 * 24 >= DEQUANTIZED_ROWS > 3  # the chunk takes the dequantized path, single rows do not
    chunk = cache.attention(q, scale, None)
    rows = mx.concatenate([cache.attention(q[..., i : i + 1, :], scale, None) for i in range(24)], axis=2)
    np.testing.assert_allclose(np.array(chunk), np.array(rows), atol=1e-4)
    if not variant.has_extras:
        assert cache.keys is not None and cache.values is not None
        kd = mx.dequantize(*cache.keys, group_size=s.group_size, bits=s.key_bits)[..., :100, :]
        vd = mx.dequantize(*cache.values, group_size=s.group_size, bits=s.value_bits)[..., :100, :]
        ref = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=scale)
        np.testing.assert_allclose(np.array(chunk), np.array(ref), atol=1e-4)


def test_rotation_makes_4_bit_keys_closer_on_outlier_channels() -> None:
    """Keys with a few large channels (as real models have) quantize better after the rotation: the cache's
    attention output is closer to the float attention with rotation than without."""
    mx.random.seed(2)
    k = mx.random.normal((1, 2, 64, 64))
    k = k + mx.zeros((64,)).at[mx.array([3, 17])].add(25.0)
    v, q = mx.random.normal((1, 2, 64, 64)), mx.random.normal((1, 2, 1, 64))
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    errors = {}
    for rotation in ("none", "hadamard"):
        cache = SchemeKVCache(4, 4, 64, rotation=rotation)
        cache.update_and_fetch(k, v)
        errors[rotation] = float(mx.abs(cache.attention(q, 0.125, None) - ref).max())
    assert errors["hadamard"] < errors["none"]


SCHEDULE = [1] * 5 + [100, 151, 1, 1, 40, 214, 1, 2]


@pytest.mark.parametrize(
    "name",
    [
        "fp16",
        "k8v4",
        "k8v8+rot",
        "k4v4+rotk+s4",
        "k4v3+rot+s4+w64",
        "k4v4g32+w16",
        "k8v4+s300",
        "k5v3+rot+s4+w64",
        "k4v4+k8@1",
        "k4v4+rot+k8@0+s4",
    ],
)
def test_cache_bytes_equal_the_plan(name: str) -> None:
    """After every update of a ragged schedule, MLX's nbytes over the model's caches equals the planner's
    allocation for the same schedule plus the scheme's fixed float copies."""
    model, spec = tiny()
    variant = parse_kv(name)
    caches = make_kv_caches(model, spec, variant)
    fed: list[int] = []
    for n in SCHEDULE:
        model(mx.random.randint(0, 97, (1, n)), cache=caches)
        mx.eval([c.state for c in caches])
        fed.append(n)
        measured = sum(c.nbytes for c in caches)
        assert measured == kv_bytes(spec, replace(variant, dtype="float32"), fed), (name, fed)
    s = variant
    for layer, cache in enumerate(caches):
        if variant.has_extras or s.key_bits_for(layer) != s.value_bits:
            assert type(cache) is SchemeKVCache


def test_k8v8_keeps_greedy_tokens_on_a_tiny_model() -> None:
    """Greedy tokens through the scheme cache at 8 bits (rotated) match an fp cache's (see also the SmolLM2
    test in test_gate_model.py)."""
    model, spec = tiny()
    prompt = mx.array([[5, 9, 13, 2, 77, 40, 41, 3]])

    def greedy(caches: list[object]) -> list[int]:
        logits = model(prompt, cache=caches)
        out = []
        for _ in range(12):
            tok = int(mx.argmax(logits[0, -1]).item())
            out.append(tok)
            logits = model(mx.array([[tok]]), cache=caches)
        return out

    ref = greedy(make_kv_caches(model, spec, parse_kv("fp16")))
    assert greedy(make_kv_caches(model, spec, parse_kv("k8v8+rot"))) == ref


def test_unsupported_schemes_are_clear_errors() -> None:
    with pytest.raises(QuantizationError, match="key bits 7"):
        parse_kv("k7v4")
    with pytest.raises(QuantizationError, match="group size 48"):
        parse_kv("k8v4g48")
    # a misspelt part is the grammar's error (exit 5), as a misspelt base is; 47 is for options a model refuses
    for text in ("k8v4+x9", "kdv4", "k8v4+rot+rot", "k4v4+k8@top0"):
        with pytest.raises(QuantizationError) as caught:
            parse_kv(text)
        assert caught.value.exit_code == QuantizationError.exit_code == 5, text
    with pytest.raises(KVSchemeError, match="quantized caches only"):
        parse_kv("fp16+rot")
    assert KVSchemeError.exit_code == 47 and issubclass(KVSchemeError, QuantizationError)
    with pytest.raises(QuantizationError, match="key bits 7"):
        parse_kv("k4v4+k7@1")
    with pytest.raises(KVSchemeError, match="quantized caches only"):
        parse_kv("fp16+k8@1")
    # one rotation, one sink count, one window, one top-layers part: a second would silently win
    for text, second in [("k8v4+rot+rot", "+rot"), ("k8v4+rot+rotk", "+rotk"), ("k8v4+s4+w8+s8", "+s8")]:
        with pytest.raises(QuantizationError, match=rf"'\{second}' after"):
            parse_kv(text)
    assert parse_kv("k4v4+k8@1+k8@2").name == "k4v4+k8@1.2"  # explicit layers add up
    # digits are ASCII: int() would read other scripts' digits, so "k８v4" would be k8v4
    with pytest.raises(QuantizationError, match="unknown KV spec"):
        parse_kv("k\uff18v4")

    # head dim 96: the 64 group does not divide it (the planner's check names the layer and a fix) ...
    from kvrig.planner.kv import check_dims

    model, spec = tiny(head_dim=96)
    with pytest.raises(QuantizationError, match="layer 0: key head dim 96 is not divisible by KV group size 64"):
        check_dims(spec, parse_kv("k8v4"))
    # ... and a Hadamard rotation needs a power-of-two head dim
    kv = host_config(spec, parse_kv("k8v4g32+rot"))
    with pytest.raises(KVSchemeError, match="field 'rotation' is hadamard but layer 0 has head dim 96"):
        make_caches(model, kv, "llama")
    # without the rotation the same scheme is fine
    make_caches(model, kv.model_copy(update={"rotation": "none"}), "llama")
    # a per-layer key width for a layer the model does not have
    with pytest.raises(QuantizationError, match="layer 5 has no quantized KV cache"):
        check_dims(spec, parse_kv("k4v4+k8@5"))


def test_layer_key_widths_reach_kvcache_json_and_the_caches() -> None:
    """`+k8@1`: kvcache.json gives layer 1 8-bit keys and the cache built from it stores 8-bit keys there
    (MLX's packed width: 64 dims x 8 bits = 16 uint32 words per row, 4 bits: 8)."""
    model, spec = tiny()
    variant = parse_kv("k4v4+k8@1")
    assert variant.name == "k4v4+k8@1"
    kv = host_config(spec, variant)
    assert [(e.key_bits, e.value_bits) for e in kv.layers] == [(4, 4), (8, 4)]
    caches = make_caches(model, kv, "llama")
    model(mx.array([[1, 2, 3]]), cache=caches)
    assert [c.keys[0].shape[-1] for c in caches] == [8, 16]
    assert [c.values[0].shape[-1] for c in caches] == [8, 8]


@pytest.mark.parametrize("name", ["k4v4+rot+s4+w16", "k3v4+w8", "k4v3+rotk+w24"])
def test_per_query_window_reads_chunks_as_decoding_reads_them(name: str) -> None:
    """With `per_query_window`, a chunked pass gives every position the logits a token-by-token pass gives it
    (each query reads its own latest tokens in float); the plain chunked pass does not."""
    from kvrig.quality.perplexity import perplexity

    model, spec = tiny()
    tokens = [int(t) for t in mx.random.randint(0, 97, (70,), key=mx.random.key(2)).tolist()]
    variant = parse_kv(name)

    def caches(per_query: bool) -> list[SchemeKVCache]:
        made = make_kv_caches(model, spec, variant)
        for c in made:
            c.per_query_window = per_query
        return made

    decoded = perplexity(model, tokens, caches(False), chunk=1).ppl
    per_query = perplexity(model, tokens, caches(True), chunk=32).ppl
    chunked = perplexity(model, tokens, caches(False), chunk=32).ppl
    assert per_query == pytest.approx(decoded, rel=1e-5)
    assert abs(chunked / decoded - 1) > 1e-4


class _Reads:
    """A kvcache.json config that notes every field read from it."""

    def __init__(self, config: object) -> None:
        self.config, self.read = config, set()

    def __getattr__(self, key: str) -> object:
        self.read.add(key)
        return getattr(self.config, key)


@pytest.mark.parametrize("name", ["k8v4", "k8v8", "k4v4+rot+s4+w16", "k4v4+k8@1", "fp16"])
@pytest.mark.parametrize("start", [0, 2])
def test_caches_read_only_the_settings_measurements_are_keyed_by(name: str, start: int) -> None:
    """The measurement cache keys a bundle's gate by `cache_settings` (kvcache.json without its plan): every field
    `make_caches` reads, watched while it builds the caches and a forward pass fills them, is one of those."""
    from kvrig.kvcache.caches import CACHE_SETTINGS

    model, spec = tiny()
    config = _Reads(host_config(spec, parse_kv(name)).model_copy(update={"quantized_kv_start": start}))
    model(mx.array([[1, 2, 3, 4]]), cache=make_caches(model, config, "llama"))  # type: ignore[arg-type]
    assert config.read and config.read <= CACHE_SETTINGS, sorted(config.read - CACHE_SETTINGS)


@pytest.mark.parametrize("name", [None, "k8v4", "k8v8", "k4v4+rot+s4+w16", "k3v4+rotk+w8", "k4v4+k8@1"])
def test_the_gate_reads_passages_side_by_side_as_it_reads_them_alone(name: str | None) -> None:
    """kind_perplexity batches a kind's equal-length passages: the perplexity equals the one of each passage read
    alone through fresh caches (`perplexity`, one row), to float rounding, for every kind of cache; a passage of
    another length is read on its own."""
    from kvrig.quality.gate import kind_perplexity
    from kvrig.quality.perplexity import perplexity

    model, spec = tiny()
    kv = None if name is None else host_config(spec, parse_kv(name))

    def caches() -> list[object]:
        return make_prompt_cache(model) if kv is None else make_caches(model, kv, "llama")

    rng = np.random.default_rng(5)
    passages = [rng.integers(1, CONFIG["vocab_size"], 40).tolist() for _ in range(3)] + [[5, 9, 2, 7, 1, 3]]
    alone = [(math.log(perplexity(model, p, caches()).ppl), len(p) - 1) for p in passages]
    expected = math.exp(sum(nll * n for nll, n in alone) / sum(n for _, n in alone))
    # A batch's matrix products round differently (OpenBLAS picks kernels by shape), and a 4-bit key near a level
    # boundary then lands on the other level: 1e-4 here. A batch that mixed its rows would be off by far more.
    assert kind_perplexity(model, passages, caches) == pytest.approx(expected, rel=1e-5 if kv is None else 1e-3)


def test_sinks_and_window_hold_their_own_bytes_through_a_prefill_not_each_layers_chunk() -> None:
    """Written as slices of the update, the sink and ring rows kept every layer's whole chunk of keys and values
    allocated until the forward pass ended: a virtual iPhone soaking k4v4+rot+s4+w64 was killed a step before
    its plan. The extras may add their own buffers (MLX's nbytes) and one layer's concatenated keys and values."""
    layers, chunk = 12, 512
    model, spec = tiny(num_hidden_layers=layers)
    prompt = mx.array([[(7 * i) % 97 for i in range(chunk)]])

    def prefill_peak(name: str) -> tuple[int, int]:
        caches = make_kv_caches(model, spec, parse_kv(name))
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        logits = model(prompt, cache=caches)
        mx.eval(logits, [c.state for c in caches])
        extras = sum(a.nbytes for c in caches for a in (*(c.sink or ()), *(c.recent or ())))
        return mx.get_peak_memory() - before, extras

    plain, _ = prefill_peak("k4v4+rot")
    with_extras, extras = prefill_peak("k4v4+rot+s4+w64")
    one_layer_chunk = 2 * CONFIG["num_key_value_heads"] * chunk * CONFIG["head_dim"] * 4  # keys and values, float32
    assert extras > 0
    assert with_extras - plain <= extras + 2 * one_layer_chunk, (with_extras - plain, extras, one_layer_chunk)
