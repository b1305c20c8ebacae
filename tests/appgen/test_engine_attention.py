"""The issue-12 check that a KV scheme means the same in the app as on the host, on numbers rather than tokens:
the engine's own cache (`MixedBitsKVCache`, read by mlx-swift-lm's `attentionWithCacheUpdate`) and the host's
`SchemeKVCache` take the same queries, keys and values in the same update sizes (prefill chunks, then single
decode steps) and must give the same attention output within float32 tolerance. Keys carry a few outlier
channels, so the rotation changes the output by far more than the tolerance: an engine that skipped it, or
read the sink/window rows from the quantized store, would fail. No Swift build runs here."""

from __future__ import annotations

import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvrig.kvcache.kv_cache import SchemeKVCache
from tests.appgen.conftest import REFERENCE_KVCACHE
from tests.appgen.swift_engine import engine_binary  # noqa: F401

HEADS, KV_HEADS, DIM = 6, 2, 64
CHUNKS = [64, 64, 63] + [1] * 9  # 191 prefilled in three chunks, then nine decode steps
SCALE = DIM**-0.5
# (key bits, value bits, rotation, sink tokens, recent tokens)
SCHEMES = [
    (8, 4, "hadamard", 0, 0),
    (4, 4, "hadamard_keys", 0, 0),
    (4, 4, "none", 0, 0),
    (3, 3, "hadamard", 4, 16),
    (5, 3, "hadamard", 4, 16),
]


def _inputs() -> dict[str, mx.array]:
    rng = np.random.default_rng(12)
    t = sum(CHUNKS)
    keys = rng.normal(size=(1, KV_HEADS, t, DIM))
    keys[..., [3, 17, 40]] *= 12.0  # outlier channels, as real keys have: what the rotation spreads
    return {
        "queries": mx.array(rng.normal(size=(1, HEADS, t, DIM)), dtype=mx.float32),
        "keys": mx.array(keys, dtype=mx.float32),
        "values": mx.array(rng.normal(size=(1, KV_HEADS, t, DIM)), dtype=mx.float32),
        "chunks": mx.array(CHUNKS, dtype=mx.int32),
        "scale": mx.array([SCALE], dtype=mx.float32),
    }


def _host(arrays: dict[str, mx.array], bits: tuple[int, int], rotation: str, sinks: int, recent: int) -> mx.array:
    cache = SchemeKVCache(*bits, 64, rotation=rotation, sink_tokens=sinks, recent_tokens=recent)
    outs, start = [], 0
    for n in CHUNKS:
        rows = slice(start, start + n)
        cache.update_and_fetch(arrays["keys"][..., rows, :], arrays["values"][..., rows, :])
        outs.append(cache.attention(arrays["queries"][..., rows, :], SCALE, "causal" if n > 1 else None))
        start += n
    return mx.concatenate(outs, axis=2)


@pytest.mark.parametrize(("key_bits", "value_bits", "rotation", "sinks", "recent"), SCHEMES)
def test_engine_attention_equals_the_host_cache(
    engine_binary: Path,  # noqa: F811
    tmp_path: Path,
    key_bits: int,
    value_bits: int,
    rotation: str,
    sinks: int,
    recent: int,
) -> None:
    kv = REFERENCE_KVCACHE.model_copy(
        update={
            "scheme": f"k{key_bits}v{value_bits}",
            "dtype": "float16",
            "key_bits": key_bits,
            "value_bits": value_bits,
            "quantized_kv_start": 0,
            "rotation": rotation,
            "sink_tokens": sinks,
            "recent_tokens": recent,
        }
    )
    (tmp_path / "kvcache.json").write_text(kv.model_dump_json(by_alias=True))
    arrays = _inputs()
    mx.save_safetensors(str(tmp_path / "in.safetensors"), arrays)
    cmd = [
        str(engine_binary),
        "--attention-probe",
        *(str(tmp_path / n) for n in ("kvcache.json", "in.safetensors", "out.safetensors")),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine = mx.load(str(tmp_path / "out.safetensors"))["output"]

    host = _host(arrays, (key_bits, value_bits), rotation, sinks, recent)
    assert engine.shape == host.shape == arrays["queries"].shape
    gap = float(mx.abs(engine - host).max())
    assert gap < 1e-4, f"engine and host attention differ by {gap}"
    # The check can fail: the same cache without its extras gives a visibly different output.
    if rotation != "none" or sinks or recent:
        plain = _host(arrays, (key_bits, value_bits), "none", 0, 0)
        assert float(mx.abs(engine - plain).max()) > 100 * max(gap, 1e-6)
