"""SmolLM2 bundles packaged once per test session and shared by test modules (packaging takes seconds), and
tiny models of any mlx-lm family saved as source folders.

Under pytest-xdist each worker is its own process; the bundles live in the folder all workers share (the parent
of each worker's base temp) and a file lock makes the first worker that needs one package it for the others.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from filelock import FileLock
from mlx.utils import tree_flatten

from kvrig.bundle.options import PackageOptions
from kvrig.models.gguf import embedded_default_model
from kvrig.models.gguf_convert import convert_gguf
from kvrig.packaging import package
from kvrig.schemas.kvcache import PressurePolicy


def _shared(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / "shared-bundles" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    done = out.with_name(name + ".done")  # beside the bundle, so its folder holds only what kvrig wrote
    with FileLock(str(out) + ".lock"):
        if not done.exists():
            make(out)
            done.touch()
    return out


def packaged(factory: pytest.TempPathFactory, name: str, options: PackageOptions) -> Path:
    return _shared(
        factory,
        name,
        lambda out: package(embedded_default_model(), out, replace(options, replace=True, quality_gate=False)),
    )


def converted_source(factory: pytest.TempPathFactory) -> Path:
    return _shared(factory, "source-smollm2", lambda out: convert_gguf(embedded_default_model(), out))


# SmolLM2 bundles several files read, each packaged once per test session (without the gate) whoever asks first.
Q4_K8V8 = PackageOptions(weights="q4", group_size=64, kv="k8v8")
Q4_K8V4 = PackageOptions(weights="q4", group_size=64, kv="k8v4")


def smollm2_q4_k8v8(factory: pytest.TempPathFactory) -> Path:
    return packaged(factory, "smollm2-q4-k8v8", Q4_K8V8)


def smollm2_q4_k8v4(factory: pytest.TempPathFactory) -> Path:
    return packaged(factory, "smollm2-q4-k8v4", Q4_K8V4)


def tiny_source(root: Path, tokenizer: Path, model_type: str, **extra: Any) -> Path:
    """A random fp16 model of `model_type` saved as a Hugging Face folder (config.json + safetensors)."""
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 256,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "torch_dtype": "float16",
        **extra,
    }
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    mx.random.seed(len(model_type))
    params = {k: (mx.random.normal(v.shape) * 0.05).astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    root.mkdir(parents=True)
    mx.save_safetensors(str(root / "model.safetensors"), params)
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    return root


# The mapped-weights soaks (tests/outcomes/test_mapped_residency.py, tests/lab/test_lab_residency.py): SmolLM2 laid
# out for mapping, fp16 KV, no eviction (where jetsam strikes is the point). A mapped run outlives a loaded one by
# the weights' bytes of KV, and the host's prefill of those tokens is what these soaks spend their time on: 2-bit
# weights, the smallest round-to-nearest recipe that quantizes every layer (groups of 128 divide none of SmolLM2's
# 576-wide inputs). Memory is the claim, not the text the bundle would write.
MAPPED_RECIPE = "q2"
MAPPED_NAME = "smollm2-q2-fp16-mapped-noevict"
MAPPED = PackageOptions(
    weights=MAPPED_RECIPE,
    kv="fp16",
    weights_layout="mapped",
    pressure=PressurePolicy(warning="none", critical="none"),
)
