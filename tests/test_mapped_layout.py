"""Mapped weights, the bundle side: every tensor on a 16 KiB page, the bytes unchanged, MLX (and so mlx-lm) loading
the file as it loads any safetensors, `kvrig verify` holding a mapped bundle to its alignment. Expected values
from MLX itself (mx.load of the original file) and from the header read here, not through kvrig's reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvrig.bundle.manifest import check_bundle
from kvrig.bundle.mapped import PAGE_BYTES, align_file
from kvrig.bundle.options import PackageOptions
from kvrig.packaging import package
from kvrig.schemas.bundle import MANIFEST_NAME, Manifest
from tests.bundle_fixtures import converted_source


def _offsets(path: Path) -> dict[str, int]:
    """Absolute file offset of each tensor, straight from the safetensors header."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    return {k: 8 + length + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _arrays(tmp_path: Path) -> Path:
    mx.random.seed(5)
    arrays = {
        "embed.weight": mx.random.normal((97, 64)).astype(mx.float16),
        "layer.q.weight": mx.random.randint(0, 2**31, (64, 8)).astype(mx.uint32),
        "layer.q.scales": mx.random.normal((64, 1)).astype(mx.float16),
        "norm.weight": mx.ones((64,), dtype=mx.float32),
        "odd": mx.arange(7, dtype=mx.int8),
    }
    path = tmp_path / "model.safetensors"
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})
    return path


def test_every_tensor_lands_on_a_page_with_its_bytes_unchanged(tmp_path: Path) -> None:
    path = _arrays(tmp_path)
    original = mx.load(str(path))
    before = {k: np.array(v) for k, v in original.items()}
    assert any(offset % PAGE_BYTES for offset in _offsets(path).values())  # MLX packs them: not aligned yet
    align_file(path)
    assert all(offset % PAGE_BYTES == 0 for offset in _offsets(path).values())
    after, metadata = mx.load(str(path), return_metadata=True)
    assert metadata == {"format": "mlx"}
    assert set(after) == set(before)
    for name, array in after.items():
        np.testing.assert_array_equal(np.array(array), before[name])
        assert (array.dtype, array.shape) == (original[name].dtype, original[name].shape)


def test_strict_safetensors_readers_refuse_the_gaps(tmp_path: Path) -> None:
    """The trade documented in bundle/mapped.py: MLX reads the gaps, the reference library does not."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = _arrays(tmp_path)
    align_file(path)
    with pytest.raises(SafetensorError):
        load_file(str(path))


@pytest.fixture(scope="module")
def mapped_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mapped") / "bundle"
    options = PackageOptions(weights="q4", kv="k8v4", quality_gate=False, weights_layout="mapped")
    package(converted_source(tmp_path_factory), out, options)
    return out


def test_a_mapped_bundle_records_its_layout_and_verifies(mapped_bundle: Path) -> None:
    manifest = Manifest.model_validate_json((mapped_bundle / MANIFEST_NAME).read_text())
    assert (manifest.recipe.weights_layout, manifest.recipe.weights_alignment_bytes) == ("mapped", PAGE_BYTES)
    kv = json.loads((mapped_bundle / "kvcache.json").read_text())
    assert (kv["schema"], kv["weights_layout"], kv["weights_alignment_bytes"]) == (3, "mapped", PAGE_BYTES)
    files = sorted(mapped_bundle.glob("*.safetensors"))
    assert files and all(o % PAGE_BYTES == 0 for f in files for o in _offsets(f).values())
    assert check_bundle(mapped_bundle).ok


def test_mlx_lm_loads_a_mapped_bundle_as_it_loads_a_plain_one(mapped_bundle: Path, tmp_path: Path) -> None:
    from mlx_lm.utils import load

    plain = tmp_path / "plain"
    package(converted_source_dir(mapped_bundle), plain, PackageOptions(weights="q4", kv="k8v4", quality_gate=False))
    # Every array mlx-lm builds from the mapped file equals the plain bundle's: the same model. (A forward pass
    # adds nothing to that, and costs seconds per token in mlx-lm's float16 on a CPU.)
    mapped = dict(tree_flatten(load(str(mapped_bundle))[0].parameters()))
    reference = dict(tree_flatten(load(str(plain))[0].parameters()))
    assert mapped.keys() == reference.keys()
    for name, array in mapped.items():
        assert array.dtype == reference[name].dtype, name
        np.testing.assert_array_equal(np.array(array), np.array(reference[name]), err_msg=name)


def test_verify_names_a_tensor_off_its_page(mapped_bundle: Path, tmp_path: Path) -> None:
    import shutil

    from kvrig.fileio import sha256_file

    copy = tmp_path / "copy"
    shutil.copytree(mapped_bundle, copy)
    weights = sorted(copy.glob("*.safetensors"))[0]
    mx.save_safetensors(str(weights), mx.load(str(weights)))  # MLX's own packing: tensors off their pages
    manifest = Manifest.model_validate_json((copy / MANIFEST_NAME).read_text())
    for entry in manifest.files:  # a manifest that agrees with the file, so only the alignment is wrong
        if entry.path == weights.name:
            entry.size, entry.sha256 = weights.stat().st_size, sha256_file(weights)
    (copy / MANIFEST_NAME).write_text(manifest.model_dump_json(by_alias=True, indent=2))
    result = check_bundle(copy)
    assert not result.ok
    assert all(p.path == weights.name and "not on a 16384-byte page" in p.problem for p in result.problems)


def converted_source_dir(bundle: Path) -> Path:
    return Path(Manifest.model_validate_json((bundle / MANIFEST_NAME).read_text()).source.path)
