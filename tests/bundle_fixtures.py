"""SmolLM2 bundles packaged once per test session and shared by test modules (packaging takes seconds).

Under pytest-xdist each worker is its own process; the bundles live in the folder all workers share (the parent
of each worker's base temp) and a file lock makes the first worker that needs one package it for the others.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from filelock import FileLock

from kvrig.bundle.options import PackageOptions
from kvrig.models.gguf import embedded_default_model
from kvrig.models.gguf_convert import convert_gguf
from kvrig.packaging import package


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
        lambda out: package(embedded_default_model(), out, replace(options, force=True, quality_gate=False)),
    )


def converted_source(factory: pytest.TempPathFactory) -> Path:
    return _shared(factory, "source-smollm2", lambda out: convert_gguf(embedded_default_model(), out))


Q4_K8V8 = PackageOptions(weights="q4", group_size=64, kv="k8v8")
