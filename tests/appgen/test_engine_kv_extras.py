"""kvcache.json's schema-2 extras (Hadamard rotation, sink tokens, recent window) mean the same in the Swift
engine as in the Python runtime: the engine built by `make test` (`kvrig engine`) and the host runtime run the
same bundle and prompt, greedily, and must give the same tokens, and the engine's KV bytes must equal the
Python runtime's caches (MLX's nbytes, counted at the phone's float16) and the planner's prediction.

The k3v3 case is there so that the extras change the answer: the same bundle without them generates other
tokens (checked there too), so an engine that ignored them could not pass. The k5v3 case is the KV moonshot's
bit widths (5-bit keys, 3-bit values: packings the k8/k4 schemes never exercise). Tokens only, not logits: the headless
engine prints token ids. No Swift build runs here; the test fails if the engine was not built first."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvrig.bundle.options import PackageOptions
from kvrig.schemas.kvcache import KVCacheConfig
from tests.appgen.swift_engine import engine_binary, read_events, run_engine  # noqa: F401
from tests.bundle_fixtures import packaged

PROMPT = "Write one sentence about the sea."
TOKENS = 6
# 37 prompt tokens: the 4 sink and 16 recent tokens leave quantized rows between them from the first chunk on.
EXTRAS = "+rot+s4+w16"
SCHEMES = ("k3v3", "k5v3")


@pytest.fixture(scope="module", params=SCHEMES)
def bundle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    options = PackageOptions(weights="q4", group_size=64, kv=request.param + EXTRAS, prefill_step_size=128)
    return packaged(tmp_path_factory, f"smollm2-q4-{request.param}-rot-s4-w16", options)


def _python_runtime(bundle: Path, kv: KVCacheConfig) -> tuple[list[int], list[Any]]:
    """Greedy tokens from kvrig's host runtime (its caches from kvcache.json, mlx-lm's generate_step) in
    float32, as the engine computes on a host: mlx-lm's model set to float32, weights dequantized."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    from kvrig.kvcache.caches import make_caches
    from kvrig.runtime.generate import encode_prompt, generate_tokens

    model, tokenizer = load(str(bundle))[:2]
    model.set_dtype(mx.float32)
    model = dequantize_model(model)
    config = json.loads((bundle / "config.json").read_text())
    caches = make_caches(model, kv, config["model_type"])
    ids = encode_prompt(tokenizer, PROMPT, chat=True)
    tokens = list(generate_tokens(model, ids, caches, kv, max_tokens=TOKENS, model_type=config["model_type"]))
    return tokens, caches


def test_engine_applies_rotation_sinks_and_window_as_the_python_runtime(
    bundle: Path,
    tmp_path: Path,
    engine_binary: Path,  # noqa: F811
) -> None:
    from kvrig.models import load_model_spec
    from kvrig.planner.kv import kv_bytes as planned_kv_bytes
    from kvrig.recipes import parse_kv
    from kvrig.virtual.llm_memory import kv_bytes

    kv = KVCacheConfig.model_validate_json((bundle / "kvcache.json").read_text())
    assert (kv.rotation, kv.sink_tokens, kv.recent_tokens) == ("hadamard", 4, 16)

    documents = tmp_path / "Documents"
    args = ("--chat", PROMPT, "--temperature", "0", "--max-tokens", str(TOKENS), "--print-tokens")
    out = run_engine(engine_binary, bundle, documents, *args, timeout=300)
    (turn,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    steps = [e for e in read_events(documents / "telemetry.jsonl") if e["event"] == "step"]

    expected, caches = _python_runtime(bundle, kv)
    assert len(expected) == TOKENS
    assert turn["tokens"] == expected

    # Both caches hold the prompt and every generated token (one 256-token step: the chunking cannot matter).
    context = steps[-1]["context_tokens"]
    assert context == max(c.offset for c in caches) < 256
    python_bytes = kv_bytes(caches, "float16")[1]
    assert steps[-1]["kv_bytes"] == python_bytes
    variant = parse_kv(f"{kv.scheme}{EXTRAS}")
    assert planned_kv_bytes(load_model_spec(bundle), replace(variant, dtype="float16"), [context]) == python_bytes

    # The extras matter at k3v3: without them the runtime answers otherwise, so equal tokens above mean the
    # engine applied them.
    if kv.scheme != "k3v3":
        return
    plain = kv.model_copy(update={"rotation": "none", "sink_tokens": 0, "recent_tokens": 0})
    assert _python_runtime(bundle, plain)[0] != expected
