"""SmolLM2 bundles packaged once per test session and shared by test modules (packaging takes seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolchain.bundle import PackageOptions, package
from toolchain.models.gguf import embedded_default_model
from toolchain.models.gguf_convert import convert_gguf

_made: dict[str, Path] = {}


def packaged(factory: pytest.TempPathFactory, name: str, options: PackageOptions) -> Path:
    if name not in _made:
        out = factory.mktemp("bundles") / name
        package(embedded_default_model(), out, options)
        _made[name] = out
    return _made[name]


def converted_source(factory: pytest.TempPathFactory) -> Path:
    if "source" not in _made:
        out = factory.mktemp("source") / "smollm2"
        convert_gguf(embedded_default_model(), out)
        _made["source"] = out
    return _made["source"]


Q4_K8V8 = PackageOptions(weights="q4", group_size=64, kv="k8v8")
