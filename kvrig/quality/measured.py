"""Perplexities measured before, kept in the user's cache folder. Every `kvrig package` measures the unquantized
source on the gate's texts, `--kv auto` each KV spec with the source weights and `--fit` each recipe with an
unquantized cache: passes over thousands of tokens that give the same numbers for the same model, so the next
package of that model (another recipe, another device) starts from them.

An entry's key is everything its numbers depend on: the source's files (sha256), what was measured (the KV
configuration, the recipe and its calibration tokens), the token ids read, kvrig's own code and the MLX and
mlx-lm versions. A change to any of them is a new key; an unreadable entry is measured again and replaced.
`KVRIG_CACHE_DIR` moves the folder; `kvrig package --no-cache` neither reads nor writes it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from kvrig.exceptions import OutputWriteError
from kvrig.fileio import atomic_write, sha256_file
from kvrig.schemas import StrictModel

CACHE_ENV = "KVRIG_CACHE_DIR"


def cache_root() -> Path:
    """`KVRIG_CACHE_DIR`, else the platform's cache folder: ~/Library/Caches/kvrig on macOS, else
    $XDG_CACHE_HOME/kvrig (~/.cache/kvrig)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "kvrig"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvrig"


class Entry(StrictModel):
    schema_version: Literal[1] = 1
    what: dict[str, Any]
    """What was measured, as the key was made from (for a reader of the folder; the key is its hash)."""
    perplexity: dict[str, float]
    """Per text kind."""


@functools.cache
def code_digest() -> str:
    """kvrig's own code and the versions of what computes the numbers: an edited checkout is a new key."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in ("mlx", "mlx-lm"):
        try:
            digest.update(f"{dist}=={metadata.version(dist)}\0".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{dist} absent\0".encode())
    return digest.hexdigest()


def source_digest(source: Path, sha256: str | None = None, *, skip: frozenset[str] = frozenset()) -> str:
    """A GGUF file's sha256 (given when already known), or a folder's: every file at its top but those named in
    `skip`, by name."""
    if source.is_file():
        return sha256 or sha256_file(source)
    digest = hashlib.sha256()
    for path in sorted(p for p in source.iterdir() if p.is_file() and p.name not in skip):
        digest.update(path.name.encode() + b"\0" + sha256_file(path).encode() + b"\0")
    return digest.hexdigest()


def ids_digest(ids: Any) -> str:
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Measurements:
    """The cache of one source's measurements (`root` None: off)."""

    root: Path | None
    source: str
    """The source's digest (`source_digest`)."""

    def perplexities(
        self,
        what: dict[str, Any],
        ids: dict[str, list[list[int]]],
        measure: Callable[[], dict[str, float]],
        *,
        enough: Callable[[dict[str, float]], bool] | None = None,
    ) -> tuple[dict[str, float], bool]:
        """Per-kind perplexities of `what` on `ids`, and whether they came from the cache; `measure` runs on a
        miss and its result is kept. `measure` may stop before the last kind (gate.kind_perplexities' `enough`):
        such an entry serves a caller whose `enough` accepts those kinds, and any other caller measures again."""
        if self.root is None:
            return measure(), False
        key_material = {"source": self.source, "code": code_digest(), "ids": ids_digest(ids), **what}
        key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()
        path = self.root / "perplexity" / key[:2] / f"{key}.json"
        if (found := _read(path, ids, enough)) is not None:
            return found, True
        # Packages of one source at once (parallel CI jobs, a lab host) measure it once: the others wait for the
        # first one's entry and read it.
        with _locked(path):
            if (found := _read(path, ids, enough)) is not None:
                return found, True
            values = measure()
            # A read-only or full cache folder costs the next run a measurement, never this one its result.
            with contextlib.suppress(OSError, OutputWriteError):
                atomic_write(path, Entry(what=key_material, perplexity=values).model_dump_json(indent=1) + "\n")
        return values, False


def _read(
    path: Path, ids: dict[str, list[list[int]]], enough: Callable[[dict[str, float]], bool] | None
) -> dict[str, float] | None:
    try:
        entry = Entry.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None  # absent, unreadable or from another format: measured again
    found = entry.perplexity
    if set(found) == set(ids):
        return found
    partial = bool(found) and set(found) < set(ids)
    return found if partial and enough is not None and enough(found) else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`'s entry, or none where the folder cannot hold one."""
    from filelock import FileLock

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(f"{path}.lock")
        lock.acquire()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()
