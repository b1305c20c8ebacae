"""manifest.json: every file of a bundle with its size and sha256, and `check_bundle` / `verify_bundle`, which
hold a bundle to it (`load_manifest` lives with the schema, for every reader of bundles)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvrig.bundle.mapped import misaligned
from kvrig.exceptions import BundleError, VerifyError
from kvrig.fileio import sha256_file
from kvrig.recipes import manifest_kv_problem
from kvrig.schemas import load_model_file
from kvrig.schemas.bundle import MANIFEST_NAME, Manifest, ManifestFile, file_problem, load_manifest
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig


def hash_files(root: Path) -> Iterator[ManifestFile]:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST_NAME:
            yield ManifestFile(path=rel, size=path.stat().st_size, sha256=sha256_file(path))


@dataclass
class FileProblem:
    path: str
    problem: str  # missing, size, sha256, unexpected


@dataclass
class VerifyResult:
    bundle: Path
    manifest: Manifest
    checked: int
    problems: list[FileProblem]

    @property
    def ok(self) -> bool:
        return not self.problems

    def error(self) -> VerifyError:
        """The error naming every file at fault (for a result that is not ok)."""
        detail = "; ".join(f"{p.path}: {p.problem}" for p in self.problems)
        return VerifyError(f"{self.bundle}: {len(self.problems)} file(s) do not match the manifest: {detail}")


def check_bundle(bundle: str | Path, *, progress: Callable[[str], None] | None = None) -> VerifyResult:
    """Every file against the manifest: present, same size, same sha256; files the manifest does not list."""
    bundle = Path(bundle)
    manifest = load_manifest(bundle)
    problems: list[FileProblem] = []
    listed = set()
    for entry in manifest.files:
        if entry.path in listed:  # a file listed twice would be counted, and deployed, twice
            problems.append(FileProblem(entry.path, "listed twice in the manifest"))
            continue
        listed.add(entry.path)
        if progress:
            progress(entry.path)
        if (problem := file_problem(bundle, entry)) is not None:
            problems.append(FileProblem(entry.path, problem))
    for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
        rel = path.relative_to(bundle).as_posix()
        if rel != MANIFEST_NAME and rel not in listed:
            problems.append(FileProblem(rel, "not listed in the manifest"))
    problems += _alignment_problems(bundle, manifest, {p.path for p in problems})
    if not problems and KVCACHE_NAME in listed:
        kv = load_model_file(KVCacheConfig, bundle / KVCACHE_NAME)  # what the app decodes: SchemaError naming the field
        if (differs := manifest_kv_problem(manifest.recipe, kv, bundle / MANIFEST_NAME)) is not None:
            problems.append(FileProblem(KVCACHE_NAME, differs))
    return VerifyResult(bundle, manifest, len(manifest.files), problems)


def _alignment_problems(bundle: Path, manifest: Manifest, broken: set[str]) -> list[FileProblem]:
    """A mapped bundle: every tensor of every listed safetensors file on its alignment boundary."""
    alignment = manifest.recipe.weights_alignment_bytes
    if manifest.recipe.weights_layout != "mapped" or alignment is None:
        return []
    problems = []
    for entry in manifest.files:
        if not entry.path.endswith(".safetensors") or entry.path in broken:
            continue
        try:
            for extent in misaligned(bundle / entry.path, alignment):
                problems.append(
                    FileProblem(
                        entry.path, f"tensor {extent.name} starts at {extent.offset}, not on a {alignment}-byte page"
                    )
                )
        except BundleError as exc:
            problems.append(FileProblem(entry.path, str(exc)))
    return problems


def verify_bundle(bundle: str | Path) -> VerifyResult:
    """Like check_bundle, but raises VerifyError naming every file at fault."""
    result = check_bundle(bundle)
    if not result.ok:
        raise result.error()
    return result
