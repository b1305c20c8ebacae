"""Turning names that come from a device into local paths that stay inside the output folder.

A phone (or anything speaking its protocols) chooses the names in a directory listing; a name like
`../../.ssh/authorized_keys`, an absolute path, a backslash path or a control character must not steer
where we write. Every component is cleaned, `..` never climbs, and the result is checked once more after
resolving. A name too long for a file system keeps its extension (a `.ips` stays a report) and gains a short
hash of the whole name, so two long names stay two files; names that differ only in case or Unicode form get
distinct files too, as macOS's default (case-insensitive, normalising) file system would otherwise merge them.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from kvrig.exceptions import DeviceError

MAX_COMPONENT_BYTES = 200
MAX_SUFFIX_BYTES = 24  # `.ips.synced`; a longer "extension" is part of the name
_SEPARATORS = re.compile(r"[/\\]+")


def clean_component(name: str) -> str:
    """One path component safe to create: no separators, control characters, NUL, or dot-only names."""
    cleaned = "".join(
        "_" if ch in "/\\\0" or unicodedata.category(ch).startswith("C") else ch
        for ch in unicodedata.normalize("NFC", name)
    ).strip()
    if not cleaned.strip("."):
        cleaned = "_" * max(1, len(cleaned))
    if len(cleaned.encode()) > MAX_COMPONENT_BYTES:
        cleaned = _shortened(cleaned)
    return cleaned


def _shortened(name: str) -> str:
    """`name` cut to MAX_COMPONENT_BYTES with its extension kept and 8 hex digits of its hash before it."""
    suffix = "".join(PurePosixPath(name).suffixes[-2:])
    if len(suffix.encode()) > MAX_SUFFIX_BYTES:
        suffix = PurePosixPath(name).suffix if len(PurePosixPath(name).suffix.encode()) <= MAX_SUFFIX_BYTES else ""
    tag = "-" + hashlib.sha256(name.encode(errors="surrogatepass")).hexdigest()[:8]
    room = MAX_COMPONENT_BYTES - len(suffix.encode()) - len(tag)
    stem = name[: len(name) - len(suffix)].encode()[:room].decode(errors="ignore")
    return stem + tag + suffix


def device_parts(device_path: str) -> list[str]:
    """The components of a device path with empty, `.` and `..` parts dropped (nothing climbs)."""
    return [p for p in _SEPARATORS.split(device_path) if p not in ("", ".", "..")]


def flat_name(device_path: str) -> str:
    """A single local file name for a device path (`Retired/JetsamEvent-x.ips` -> `Retired_JetsamEvent-x.ips`)."""
    parts = device_parts(device_path)
    return clean_component("_".join(parts)) if parts else "_"


def safe_join(root: Path, relative: str | list[str]) -> Path:
    """`root / relative` with every component cleaned; raises DeviceError if it would still leave `root`."""
    parts = device_parts(relative) if isinstance(relative, str) else [p for p in relative if p not in ("", ".", "..")]
    target = root.joinpath(*(clean_component(p) for p in parts)) if parts else root / "_"
    resolved_root = root.resolve()
    resolved = target.parent.resolve() / target.name
    if not resolved.is_relative_to(resolved_root) or resolved == resolved_root:
        raise DeviceError(f"refusing to write {relative!r} from the device outside {root}")
    return target


def name_key(name: str) -> str:
    """What a case-insensitive, normalising file system (macOS's default) sees of a name."""
    return unicodedata.normalize("NFD", name).casefold()


def taken_names(folder: Path) -> set[str]:
    """The names already in `folder`, as `unique` compares them."""
    return {name_key(p.name) for p in folder.iterdir()} if folder.is_dir() else set()


def unique(path: Path, taken: set[str]) -> Path:
    """`path`, or `path` with a -1, -2... before its extension when its name (ignoring case and Unicode form) is
    taken already: by an earlier name from the same listing, or a file in the folder."""
    candidate, n = path, 0
    while name_key(candidate.name) in taken:
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    taken.add(name_key(candidate.name))
    return candidate


@contextmanager
def new_file(path: Path) -> Iterator[BinaryIO]:
    """`path` opened for writing from empty, without following a symlink that might sit there (it would point
    anywhere)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        yield f
