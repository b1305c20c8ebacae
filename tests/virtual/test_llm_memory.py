"""The LLM app runtime's parts on real MLX arrays: phone-format accounting, eviction, the pressure decision,
finding the bundle."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvrig.kvcache.kv_cache import DequantizingKVCache
from kvrig.schemas.kvcache import KVCacheConfig, LayerCache, PressurePolicy, host_kvcache
from kvrig.virtual.llm_memory import Residency, evict_front, kv_bytes, phone_residency, respond, stored_weight_bytes
from kvrig.virtual.llmapp import AppError, find_bundle

HEADS, DIM = 3, 64


def _kv(**changes: object) -> KVCacheConfig:
    base = host_kvcache(
        [LayerCache(layer=0, kind="full", key_bits=8, value_bits=4)],
        max_context=8192,
        prefill_step_size=512,
        scheme="k8v4",
        key_bits=8,
        value_bits=4,
    )
    return base.model_copy(update=changes)


def _filled(cache, tokens: int, dtype=mx.float32):  # type: ignore[no-untyped-def]
    mx.random.seed(0)
    keys = mx.random.normal((1, HEADS, tokens, DIM)).astype(dtype)
    values = mx.random.normal((1, HEADS, tokens, DIM)).astype(dtype)
    cache.update_and_fetch(keys, values)
    return cache


def test_stored_weight_bytes_reads_safetensors_headers(tmp_path: Path) -> None:
    arrays = {
        "a": mx.zeros((7, 64), dtype=mx.uint32),
        "b": mx.zeros((7, 2), dtype=mx.float16),
        "c": mx.zeros((576,), dtype=mx.float32),
    }
    mx.save_safetensors(str(tmp_path / "model.safetensors"), arrays)
    loaded = mx.load(str(tmp_path / "model.safetensors"))
    assert stored_weight_bytes(tmp_path) == sum(a.nbytes for a in loaded.values())


def test_float32_cache_counts_as_the_phones_float16_for_the_same_shapes() -> None:
    host = _filled(DequantizingKVCache(8, 4, 64), 300, mx.float32)
    phone = _filled(DequantizingKVCache(8, 4, 64), 300, mx.float16)
    host_bytes, phone_bytes = kv_bytes([host], "float16")
    assert host_bytes == host.nbytes > phone.nbytes
    assert phone_bytes == phone.nbytes  # MLX's own nbytes of the same cache holding float16


@pytest.mark.parametrize("make", [lambda: DequantizingKVCache(8, 4, 64), KVCache])
def test_eviction_drops_the_oldest_pages_after_the_kept_tokens(make) -> None:  # type: ignore[no-untyped-def]
    cache = _filled(make(), 600)
    before_k, before_v = (mx.array(x) for x in _read(cache))
    assert evict_front(cache, keep=4, count=256) == 256
    assert cache.offset == 344
    after_k, after_v = _read(cache)
    expected_k = mx.concatenate([before_k[..., :4, :], before_k[..., 260:600, :]], axis=-2)
    expected_v = mx.concatenate([before_v[..., :4, :], before_v[..., 260:600, :]], axis=-2)
    assert mx.array_equal(after_k, expected_k) and mx.array_equal(after_v, expected_v)
    # The buffers shrink to what is left (a one-step cache gives the bytes per token), then grow by a step.
    per_token = kv_bytes([_filled(make(), 256)], "float32")[0] // 256
    assert kv_bytes([cache], "float32")[0] == 344 * per_token
    _filled(cache, 1)
    assert cache.offset == 345 and kv_bytes([cache], "float32")[0] == (344 + 256) * per_token


def _read(cache):  # type: ignore[no-untyped-def]
    if isinstance(cache, DequantizingKVCache):
        return cache.keys_and_values()
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


def test_eviction_keeps_at_least_the_kept_tokens() -> None:
    cache = _filled(KVCache(), 100)
    assert evict_front(cache, keep=4, count=256) == 96
    assert cache.offset == 4
    assert evict_front(cache, keep=4, count=256) == 0


@pytest.mark.parametrize(
    ("level", "context", "on_critical", "policy", "expected"),
    [
        ("normal", 5000, "stop_and_save", PressurePolicy(), ("nothing", 0)),
        ("warning", 600, "stop_and_save", PressurePolicy(), ("evict", 256)),
        ("warning", 600, "stop_and_save", PressurePolicy(warning_evict_pages=3), ("evict", 512)),
        ("warning", 200, "stop_and_save", PressurePolicy(), ("nothing", 0)),
        ("warning", 600, "stop_and_save", PressurePolicy(warning="none"), ("nothing", 0)),
        ("critical", 600, "stop_and_save", PressurePolicy(), ("stop", 0)),
        ("critical", 600, "continue", PressurePolicy(), ("evict", 256)),
        ("critical", 200, "continue", PressurePolicy(), ("nothing", 0)),
        ("critical", 200, "stop_and_save", PressurePolicy(critical="evict_oldest_pages"), ("stop", 0)),
        ("critical", 600, "stop_and_save", PressurePolicy(critical="none"), ("nothing", 0)),
    ],
)
def test_pressure_decision_follows_the_policy(level, context, on_critical, policy, expected) -> None:  # type: ignore[no-untyped-def]
    assert respond(level, context, _kv(pressure=policy), on_critical) == expected


def _bundle(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "kvcache.json").write_text("{}")
    (path / "manifest.json").write_text("{}")
    return path


def test_find_bundle(tmp_path: Path) -> None:
    docs = tmp_path / "Documents"
    docs.mkdir()
    (docs / "not-a-bundle").mkdir()
    with pytest.raises(AppError, match="no model bundle in Documents"):
        find_bundle(docs)
    one = _bundle(docs / "smollm2")
    assert find_bundle(docs) == one
    _bundle(docs / "other")
    with pytest.raises(AppError, match=r"several bundles in Documents \(other, smollm2\)"):
        find_bundle(docs)
    assert find_bundle(docs, "other") == (docs / "other").resolve()
    with pytest.raises(AppError, match="outside Documents"):
        find_bundle(docs, "../elsewhere")
    with pytest.raises(AppError, match="no bundle at Documents/not-a-bundle"):
        find_bundle(docs, "not-a-bundle")


def _mapped_bundle(path: Path, *, align: bool = True) -> tuple[Path, KVCacheConfig]:
    """A bundle folder with two safetensors files (aligned to the phone's page, or as MLX packs them) and a
    kvcache.json laid out for mapping."""
    from kvrig.bundle.mapped import PAGE_BYTES, align_file

    path.mkdir(parents=True)
    mx.random.seed(3)
    for i, shapes in enumerate([((97, 64), (64,)), ((33, 8),)]):
        arrays = {f"t{i}.{j}": mx.random.normal(shape).astype(mx.float16) for j, shape in enumerate(shapes)}
        mx.save_safetensors(str(path / f"model-{i}.safetensors"), arrays)
        if align:
            align_file(path / f"model-{i}.safetensors")
    kv = _kv(schema_version=3, weights_layout="mapped", weights_alignment_bytes=PAGE_BYTES)
    return path, kv


def test_the_phone_maps_an_aligned_bundle_unless_the_plan_says_loaded(tmp_path: Path) -> None:
    bundle, kv = _mapped_bundle(tmp_path / "b")
    # Expected bytes from MLX itself: every tensor as loaded.
    nbytes = sum(a.nbytes for f in sorted(bundle.glob("*.safetensors")) for a in mx.load(str(f)).values())
    assert phone_residency(bundle, kv, None) == Residency("mapped", nbytes)
    assert phone_residency(bundle, kv, "mapped") == Residency("mapped", nbytes)
    assert phone_residency(bundle, kv, "loaded") == Residency("loaded", 0)


def test_the_phone_falls_back_to_loading_and_says_why(tmp_path: Path) -> None:
    bundle, kv = _mapped_bundle(tmp_path / "packed", align=False)
    fallback = phone_residency(bundle, kv, "mapped")
    assert (fallback.residency, fallback.mapped_weight_bytes) == ("loaded", 0)
    assert fallback.note is not None and "model-0.safetensors" in fallback.note and "16384-byte page" in fallback.note
    plain = _kv()  # a bundle packaged for loading: the plan cannot make it mappable
    fallback = phone_residency(_mapped_bundle(tmp_path / "plain")[0], plain, "mapped")
    assert fallback.residency == "loaded" and "--weights-layout mapped" in (fallback.note or "")
    assert phone_residency(tmp_path / "plain", plain, None) == Residency("loaded")
