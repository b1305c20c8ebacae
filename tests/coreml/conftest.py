"""Bundles and their Core ML exports, made once per session: the real SmolLM2 (q4) and tiny models of the other
families the exporter takes, built from arguments with mlx-lm and packaged with `kvrig package`."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from kvrig.bundle.options import PackageOptions
from kvrig.coreml.export import ExportResult, export_coreml
from kvrig.packaging import package
from tests.bundle_fixtures import smollm2_q4_k8v8, tiny_source

logging.getLogger("coremltools").setLevel(logging.ERROR)

SMOL_CONTEXT = 256


@pytest.fixture(scope="session")
def smol_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm2_q4_k8v8(tmp_path_factory)


@pytest.fixture(scope="session")
def smol_export(smol_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportResult:
    out = tmp_path_factory.mktemp("coreml") / "SmolLM2.mlpackage"
    return export_coreml(smol_bundle, out, context=SMOL_CONTEXT)


# name -> (model type, weights recipe, extra config)
TINY = {
    "llama-q8-untied": ("llama", "q8", {"tie_word_embeddings": False}),
    "qwen2-q4": ("qwen2", "q4", {}),
    "qwen3-q8": ("qwen3", "q8", {}),
    # kvrig's mixed layout: 4-bit throughout, some layers in groups of 32 (their own entry in config.json)
    "llama-gpx-4.6": ("llama", "gpx-4.6", {"vocab_size": 49152}),  # SmolLM2's: its tokenizer calibrates it
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
