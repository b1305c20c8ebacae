"""manifest.json for the test bundles written by hand: over the folder's files as they are now, as `kvrig package`
writes one (the appgen and device tests' bundles, whose files are not a real model's)."""

from __future__ import annotations

from pathlib import Path

from kvrig.bundle.manifest import hash_files
from kvrig.schemas.bundle import MANIFEST_NAME, Manifest, Recipe, SourceModel
from kvrig.schemas.kvcache import KVCacheConfig


def write_manifest(folder: Path, kv: KVCacheConfig, *, weights: str = "q8", bits: int = 8, kv_spec: str = "") -> Path:
    """The manifest of a `weights` bundle (`bits` per weight) with `kv`'s scheme; `kv_spec`: the recipe's KV spec in
    full (empty, as in manifests written before it was recorded)."""
    manifest = Manifest(
        tool_version="test",
        created="2026-12-05T00:00:00+00:00",
        source=SourceModel(kind="hf", path="tests", name="tests", architecture="llama"),
        recipe=Recipe(
            weights=weights,
            bits=bits,
            group_size=64,
            kv_scheme=kv.scheme,
            kv=kv_spec,
            key_bits=kv.key_bits,
            value_bits=kv.value_bits,
            kv_group_size=kv.group_size,
        ),
        prediction=None,
        files=list(hash_files(folder)),
    )
    (folder / MANIFEST_NAME).write_text(manifest.model_dump_json(by_alias=True, indent=2))
    return folder
