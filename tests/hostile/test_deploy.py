"""Tampered bundles (defect 2 of issue 24): `kvrig deploy` sends exactly the regular files the manifest lists,
each checked against its sha256 as it goes; an unlisted file, a link or a file that does not match stops it with
exit 8, and nothing it points to, nor anything that did not match, reaches the phone under a final name."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tests.device.test_device_files import make_bundle
from tests.hostile.conftest import BUNDLE_ID, Emulator, installed, kvrig
from tests.hostile_suite import hostile

__all__ = ["installed"]
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot for the phone\n"


def _deploy(emulator: Emulator, bundle: Path):  # type: ignore[no-untyped-def]
    return kvrig("deploy", str(bundle), "--app-id", BUNDLE_ID, "--udid", emulator.udid, timeout=120)


def _on_phone(emulator: Emulator) -> dict[str, bytes]:
    documents = emulator.device.state.container(BUNDLE_ID) / "Documents"
    return {p.relative_to(documents).as_posix(): p.read_bytes() for p in documents.rglob("*") if p.is_file()}


def _no_secret_on_the_phone(emulator: Emulator) -> None:
    assert not any(SECRET in data for data in _on_phone(emulator).values())


@hostile(2, "an unlisted symlink notes.txt -> ~/.ssh/id_rsa in a bundle", "deploy exit 8; the key never leaves")
def test_an_unlisted_link_stops_the_deploy(installed: Emulator, tmp_path: Path) -> None:
    secret = tmp_path / "id_rsa"
    secret.write_bytes(SECRET)
    bundle = make_bundle(tmp_path / "linked", weight_bytes=5_000)
    (bundle / "notes.txt").symlink_to(secret)
    ran = _deploy(installed, bundle)
    assert ran.code == 8, ran.stderr
    assert "notes.txt (symbolic link)" in ran.stderr and "Traceback" not in ran.stderr
    assert "linked" not in {name.split("/")[0] for name in _on_phone(installed)}  # refused before the phone
    _no_secret_on_the_phone(installed)


@hostile(2, "an unlisted regular file in a bundle", "deploy exit 8, as kvrig verify refuses it")
def test_an_unlisted_file_stops_the_deploy(installed: Emulator, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "extra", weight_bytes=5_000)
    (bundle / "notes.txt").write_bytes(SECRET)
    ran = _deploy(installed, bundle)
    assert ran.code == 8, ran.stderr
    assert "not listed in manifest.json" in ran.stderr and "notes.txt (file)" in ran.stderr
    _no_secret_on_the_phone(installed)


@hostile(2, "a listed file replaced by a link to a copy of itself", "deploy exit 8: only regular files go")
def test_a_listed_file_that_is_a_link_stops_the_deploy(installed: Emulator, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "swapped", weight_bytes=5_000)
    name = "model-00003-of-00004.safetensors"
    copy = tmp_path / "elsewhere.bin"
    copy.write_bytes((bundle / name).read_bytes())
    (bundle / name).unlink()
    (bundle / name).symlink_to(copy)
    ran = _deploy(installed, bundle)
    assert ran.code == 8, ran.stderr
    assert f"{name}: a symbolic link, not a regular file" in ran.stderr


@hostile(2, "a listed file edited after packaging (same size)", "deploy exit 8 before the phone: nothing lands")
def test_a_file_that_does_not_match_never_lands(installed: Emulator, tmp_path: Path) -> None:
    """Every file is held to its sha256 before the phone is touched, as `kvrig verify` holds it (the push checks
    each again as it streams: a file changed in between never lands under its final name either)."""
    bundle = make_bundle(tmp_path / "edited", weight_bytes=5_000)
    name = "model-00002-of-00004.safetensors"
    (bundle / name).write_bytes(os.urandom(5_000))
    ran = _deploy(installed, bundle)
    assert ran.code == 8, ran.stderr
    assert f"{name}: sha256 differs from the manifest" in ran.stderr
    assert "edited" not in {name.split("/")[0] for name in _on_phone(installed)}


@hostile(2, "a manifest that lists ../outside.bin with its true size and hash", "deploy exit 8; nothing outside read")
def test_a_manifest_path_that_escapes_stops_the_deploy(installed: Emulator, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "escape", weight_bytes=5_000)
    (tmp_path / "outside.bin").write_bytes(SECRET)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"].append(
        {"path": "../outside.bin", "size": len(SECRET), "sha256": hashlib.sha256(SECRET).hexdigest()}
    )
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    ran = _deploy(installed, bundle)
    assert ran.code == 8, ran.stderr
    assert "../outside.bin is in manifest.json but missing from the folder" in ran.stderr
    _no_secret_on_the_phone(installed)
