"""Shared fixtures for the app generator: a minimal bundle written from the pydantic models, one rendering."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvrig.appgen.render import AppOptions, render_app
from kvrig.schemas.kvcache import KVCacheConfig, LayerCache, PressurePolicy
from tests.manifests import write_manifest

# Every field set away from its default, every layer kind, per-layer bits: what the contract tests decode.
REFERENCE_KVCACHE = KVCacheConfig(
    scheme="k8v4",
    dtype="bfloat16",
    key_bits=8,
    value_bits=4,
    group_size=64,
    quantized_kv_start=512,
    rotation="hadamard",
    sink_tokens=4,
    recent_tokens=128,
    step=256,
    page_tokens=128,
    max_context=8192,
    keep_tokens=4,
    prefill_step_size=256,
    buffer_cache_limit_bytes=20 * 1024 * 1024,
    memory_limit_bytes=3 * 1024**3,
    pressure=PressurePolicy(warning="evict_oldest_pages", warning_evict_pages=2, critical="evict_oldest_pages"),
    layers=[
        LayerCache(layer=0, kind="full", key_bits=8, value_bits=8),
        LayerCache(layer=1, kind="sliding", window=512),
        LayerCache(layer=2, kind="shared", source_layer=0),
        LayerCache(layer=3, kind="linear"),
        LayerCache(layer=4, kind="latent", key_bits=4, value_bits=4),
        LayerCache(layer=5, kind="full"),
    ],
)
REFERENCE_OPTIONS = AppOptions(name="SmolLM2 Chat", bundle_id="com.example.smollm2", team="ABCDE12345")


def write_bundle(folder: Path, kv: KVCacheConfig = REFERENCE_KVCACHE) -> Path:
    """The files of a bundle the app reads (kvcache.json, config.json) under a manifest, as `kvrig package` writes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kvcache.json").write_text(kv.model_dump_json(by_alias=True, indent=2))
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    return seal(folder, kv)


def seal(folder: Path, kv: KVCacheConfig = REFERENCE_KVCACHE) -> Path:
    """(Re)writes the manifest over the folder's files as they are now: a bundle whose files, edited or not, agree
    with it (a bad file kvrig package could have written, not one edited after)."""
    return write_manifest(folder, kv)


@pytest.fixture(scope="session")
def reference_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bundle(tmp_path_factory.mktemp("bundle") / "SmolLM2-135M-k8v4")


@pytest.fixture(scope="session")
def reference_project(tmp_path_factory: pytest.TempPathFactory, reference_bundle: Path) -> Path:
    out = tmp_path_factory.mktemp("app") / "SmolLM2Chat"
    render_app(reference_bundle, out, REFERENCE_OPTIONS)
    return out


def swift_executable() -> str | None:
    return shutil.which("swift") or ("/opt/swift/usr/bin/swift" if Path("/opt/swift/usr/bin/swift").exists() else None)


@pytest.fixture(scope="session")
def make_bundle():  # type: ignore[no-untyped-def]
    return write_bundle


@pytest.fixture(scope="session")
def reseal():  # type: ignore[no-untyped-def]
    return seal


@pytest.fixture(scope="session")
def reference_kvcache() -> KVCacheConfig:
    return REFERENCE_KVCACHE


@pytest.fixture(scope="session")
def swift() -> str:
    found = swift_executable()
    if found is None:
        pytest.skip("no Swift toolchain (expected at /opt/swift/usr/bin)")
    return found
