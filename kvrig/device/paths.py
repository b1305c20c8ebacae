"""Turning names that come from a device into local paths that stay inside the output folder.

A phone (or anything speaking its protocols) chooses the names in a directory listing; a name like
`../../.ssh/authorized_keys`, an absolute path, a backslash path or a control character must not steer
where we write. Every component is cleaned, `..` never climbs, and the result is checked once more after
resolving.
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

from kvrig.exceptions import DeviceError

MAX_COMPONENT_BYTES = 200
_SEPARATORS = re.compile(r"[/\\]+")


def clean_component(name: str) -> str:
    """One path component safe to create: no separators, control characters, NUL, or dot-only names."""
    cleaned = "".join(
        "_" if ch in "/\\\0" or unicodedata.category(ch).startswith("C") else ch
        for ch in unicodedata.normalize("NFC", name)
    ).strip()
    if not cleaned.strip("."):
        cleaned = "_" * max(1, len(cleaned))
    encoded = cleaned.encode()
    if len(encoded) > MAX_COMPONENT_BYTES:
        cleaned = encoded[:MAX_COMPONENT_BYTES].decode(errors="ignore")
    return cleaned


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


def unique(path: Path, taken: set[Path]) -> Path:
    """`path`, or `path` with a -1, -2... suffix if an earlier name from the same listing already mapped there."""
    candidate, n = path, 0
    while candidate in taken:
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    taken.add(candidate)
    return candidate


def write_new_file(path: Path, data: bytes) -> None:
    """Writes `data` without following a symlink that might sit at `path` (it would point anywhere)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
