"""Pushing a bundle into the app's Documents over house_arrest/AFC: an unplug mid-transfer, replug, and a
resume that re-sends only what is missing; manifest checks; pulling files back out."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrig.device import files
from kvrig.device.files import Progress, pull, push_bundle
from kvrig.exceptions import DeviceLostError, VerifyError
from kvrig.virtual.faults import FaultPlan
from tests.device.conftest import BUNDLE_ID, Emulator, installed, on_device, run

__all__ = ["installed"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_bundle(root: Path, *, weight_bytes: int = 200_000, manifest: bool = True) -> Path:
    """A bundle-shaped folder (random weights, config, tokenizer, a kvcache.json the app reads) under a manifest as
    `kvrig package` writes one (what deploy and `kvrig verify` hold every file to)."""
    from kvrig.schemas.kvcache import LayerCache, host_kvcache
    from tests.manifests import write_manifest

    root.mkdir(parents=True)
    kv = host_kvcache([LayerCache(layer=0, kind="full")], max_context=256, prefill_step_size=64)
    files = {
        "config.json": b'{"model_type": "llama"}',
        "kvcache.json": kv.model_dump_json(by_alias=True, indent=2).encode(),
        "tokenizer/tokenizer.json": os.urandom(30_000),
        **{f"model-{i:05d}-of-00004.safetensors": os.urandom(weight_bytes) for i in range(1, 5)},
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    if manifest:
        write_manifest(root, kv, weights="q4", bits=4, kv_spec=kv.spec)
    return root


def _remote(emulator: Emulator, name: str) -> Path:
    return emulator.device.state.container(BUNDLE_ID) / "Documents" / name


def _local_files(bundle: Path) -> dict[str, bytes]:
    return {p.relative_to(bundle).as_posix(): p.read_bytes() for p in bundle.rglob("*") if p.is_file()}


@pytest.fixture()
def unplug_clean(installed: Emulator) -> Iterator[Emulator]:
    yield installed
    installed.device.faults = FaultPlan()
    installed.host.run(installed.device.replug())


def test_unplug_replug_resume_sends_only_missing_files(unplug_clean: Emulator, tmp_path: Path) -> None:
    emulator = unplug_clean
    bundle = make_bundle(tmp_path / "smol-q4")
    local = _local_files(bundle)
    emulator.device.afc_bytes = 0
    emulator.device.faults = FaultPlan(unplug_after_afc_bytes=450_000)

    with pytest.raises(DeviceLostError):
        run(on_device(emulator.udid, lambda d: push_bundle(d, BUNDLE_ID, bundle)))
    emulator.host.run(emulator.device.replug())

    # What survived, judged from the emulator's disk: whole files under their final names.
    remote_dir = _remote(emulator, "smol-q4")
    complete = {n for n, data in local.items() if (remote_dir / n).exists() and (remote_dir / n).read_bytes() == data}
    assert complete and set(local) - complete, "the unplug should land mid-bundle"
    assert not (remote_dir / "manifest.json").exists()  # the manifest goes last

    events: list[Progress] = []
    result = run(on_device(emulator.udid, lambda d: push_bundle(d, BUNDLE_ID, bundle, progress=events.append)))
    assert set(result.skipped) == complete
    assert set(result.sent) == set(local) - complete
    assert result.bytes_sent == sum(len(local[n]) for n in result.sent)
    assert result.bytes_skipped == sum(len(local[n]) for n in complete)
    assert events[-1].sent == events[-1].to_send == result.bytes_sent
    assert result.sent[-1] == "manifest.json"

    for name, data in local.items():
        assert _sha((remote_dir / name).read_bytes()) == _sha(data), name
    leftovers = [p.name for p in remote_dir.rglob("*") if p.name.endswith(".kvrig-partial")]
    assert leftovers == []

    again = run(on_device(emulator.udid, lambda d: push_bundle(d, BUNDLE_ID, bundle)))
    assert again.sent == [] and set(again.skipped) == set(local)


def test_same_size_new_content_is_resent_when_the_manifest_says_so(installed: Emulator, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "requant", weight_bytes=50_000)
    run(on_device(installed.udid, lambda d: push_bundle(d, BUNDLE_ID, bundle)))
    # re-quantized weights: same shapes, same size, other bytes; the manifest is rewritten with them
    name = "model-00002-of-00004.safetensors"
    new = os.urandom(50_000)
    (bundle / name).write_bytes(new)
    manifest = json.loads((bundle / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == name:
            entry["sha256"] = _sha(new)
    (bundle / "manifest.json").write_text(json.dumps(manifest))

    result = run(on_device(installed.udid, lambda d: push_bundle(d, BUNDLE_ID, bundle)))
    assert result.sent == [name, "manifest.json"]
    assert _remote(installed, f"requant/{name}").read_bytes() == new


def test_without_a_manifest_small_files_are_hashed_large_ones_sized(
    installed: Emulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "HASH_UNLISTED_BELOW", 20_000)
    bundle = make_bundle(tmp_path / "plain", weight_bytes=30_000, manifest=False)
    first = run(on_device(installed.udid, lambda d: push_bundle(d, BUNDLE_ID, bundle)))
    assert "manifest.json" not in first.sent and len(first.sent) == 7
    (bundle / "config.json").write_bytes(b'{"model_type": "qwen2"}')  # same size, other content: hashed
    big = "model-00001-of-00004.safetensors"
    (bundle / big).write_bytes(os.urandom(30_000))  # same size, large and unlisted: size decides
    second = run(on_device(installed.udid, lambda d: push_bundle(d, BUNDLE_ID, bundle)))
    assert second.sent == ["config.json"]
    assert _remote(installed, "plain/config.json").read_bytes() == b'{"model_type": "qwen2"}'


def test_bundle_that_does_not_match_its_manifest_is_refused(installed: Emulator, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "broken", weight_bytes=10_000)
    name = "model-00001-of-00004.safetensors"
    (bundle / name).write_bytes(os.urandom(10_000))  # same size, content no longer what the manifest says
    with pytest.raises(VerifyError, match="sha256"):
        run(on_device(installed.udid, lambda d: push_bundle(d, BUNDLE_ID, bundle)))
    (bundle / name).write_bytes(b"short")
    with pytest.raises(VerifyError, match="manifest says 10000"):
        run(on_device(installed.udid, lambda d: push_bundle(d, BUNDLE_ID, bundle)))


def test_pull_copies_a_folder_out_of_documents(installed: Emulator, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "roundtrip", weight_bytes=20_000)
    run(on_device(installed.udid, lambda d: push_bundle(d, BUNDLE_ID, bundle)))
    out = tmp_path / "pulled"
    pulled = run(on_device(installed.udid, lambda d: pull(d, BUNDLE_ID, "/Documents/roundtrip", out)))
    assert {p.relative_to(out / "roundtrip").as_posix() for p in pulled} == set(_local_files(bundle))
    assert _local_files(out / "roundtrip") == _local_files(bundle)
