"""Bundles and their Core ML exports, made once per session: the real SmolLM2 (q4) and tiny models of the other
families the exporter takes, built from arguments with mlx-lm and packaged with `kvrig package`."""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kvrig.bundle.options import PackageOptions
from kvrig.coreml.export import ExportResult, export_coreml
from kvrig.packaging import package
from tests.bundle_fixtures import Q4_K8V8, packaged

logging.getLogger("coremltools").setLevel(logging.ERROR)

SMOL_CONTEXT = 256


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


@pytest.fixture(scope="session")
def smol_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return packaged(tmp_path_factory, "q4_k8v8", Q4_K8V8)


@pytest.fixture(scope="session")
def smol_export(smol_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportResult:
    out = tmp_path_factory.mktemp("coreml") / "SmolLM2.mlpackage"
    return export_coreml(smol_bundle, out, context=SMOL_CONTEXT)


# name -> (model type, weights recipe, extra config)
TINY = {
    "llama-q8-untied": ("llama", "q8", {"tie_word_embeddings": False}),
    "qwen2-q4": ("qwen2", "q4", {}),
    "qwen3-q8": ("qwen3", "q8", {}),
}


@pytest.fixture(scope="session")
def tiny_exports(smol_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ExportResult]:
    root = tmp_path_factory.mktemp("tiny-coreml")
    out = {}
    for name, (model_type, weights, extra) in TINY.items():
        src = tiny_source(root / f"{name}-src", smol_bundle / "tokenizer.json", model_type, **extra)
        bundle = root / f"{name}-bundle"
        package(src, bundle, PackageOptions(weights=weights, kv="fp16", max_context=64, quality_gate=False))
        out[name] = export_coreml(bundle, root / f"{name}.mlpackage")
    return out


@functools.cache
def load_program(package_path: Path) -> Any:
    """The saved package read back by coremltools' own MIL loader (the program with its constants)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load

    spec = ct.models.MLModel(str(package_path), skip_model_load=True).get_spec()
    return load(spec, spec.specificationVersion, os.path.join(package_path, "Data", "com.apple.CoreML", "weights"))
