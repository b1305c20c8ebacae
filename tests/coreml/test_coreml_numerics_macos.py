"""Numerics of the exported program against mlx-lm on the same bundle. Needs Core ML itself (macOS 15+): on
Linux coremltools can build and save a package but not run it, so this is marked `macos`."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kvrig.coreml.export import ExportResult

pytestmark = pytest.mark.macos

PROMPT = "The capital of France is"
STEPS = 8


def _mlx_greedy(bundle: Path, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(bundle))
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1].astype(mx.float32)
    first = np.array(logits)
    out = []
    for _ in range(STEPS):
        token = int(mx.argmax(logits))
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
    return first, out


@pytest.mark.skipif(sys.platform != "darwin", reason="running a Core ML model needs macOS")
def test_prefill_then_decode_matches_mlx(smol_export: ExportResult, smol_bundle: Path) -> None:
    import coremltools as ct
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(smol_bundle / "tokenizer.json")).encode(PROMPT).ids
    model = ct.models.MLModel(smol_export.output, compute_units=ct.ComputeUnit.CPU_AND_GPU)
    state = model.make_state()
    # Prefill: the whole prompt in one call; decode: one token per call at the next position.
    out = model.predict({"input_ids": np.array([ids], np.int32), "position": np.array([0], np.int32)}, state=state)
    logits = out["logits"][0].astype(np.float32)
    ref_logits, ref_tokens = _mlx_greedy(smol_bundle, ids)
    cosine = float(logits @ ref_logits / (np.linalg.norm(logits) * np.linalg.norm(ref_logits)))
    assert cosine > 0.995
    assert int(np.argmax(logits)) == int(np.argmax(ref_logits))
    tokens, position = [], len(ids)
    token = int(np.argmax(logits))
    for _ in range(STEPS):
        tokens.append(token)
        out = model.predict(
            {"input_ids": np.array([[token]], np.int32), "position": np.array([position], np.int32)}, state=state
        )
        position += 1
        token = int(np.argmax(out["logits"][0]))
    assert tokens == ref_tokens
