"""Weights the app can map from the file: every tensor of the bundle's safetensors starts on a 16 KiB boundary
(the iPhone's page size), so the app maps the file read-only once and hands each tensor's pages to MLX without a
copy; iOS then counts those clean, file-backed pages outside the app's footprint.

The layout is safetensors with gaps: the header is padded with spaces to end on a boundary, and each tensor's
data starts on the next boundary after the previous one's end. MLX's own loader (Python's `mx.load`, hence
mlx-lm, and MLX Swift's `loadArrays`) reads it as it reads any safetensors, so the bundle stays loadable on the
host and the app's fallback; the reference `safetensors` library refuses gaps between tensors. One file, no
second copy of the weights on the phone: that is the trade chosen here.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvrig.exceptions import BundleError
from kvrig.fileio import SafetensorsHeaderError, safetensors_header

PAGE_BYTES: Final = 16384
"""The iPhone's VM page size (16 KiB on every A9 and later SoC); what the app's mapping aligns to."""
_HEADER_LEN = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorExtent:
    name: str
    offset: int
    """absolute: from the start of the file."""
    size: int


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors file's tensors and where the data starts, or BundleError naming the file."""
    try:
        return safetensors_header(path)
    except SafetensorsHeaderError as exc:
        raise BundleError(f"{path}: {exc}") from None


def extents(path: Path) -> list[TensorExtent]:
    """Every tensor of the file with its absolute offset and size, in file order."""
    header, data_start = read_header(path)
    out = [TensorExtent(name, data_start + begin, end - begin) for name, (begin, end) in _offsets(header)]
    return sorted(out, key=lambda e: e.offset)


def _offsets(header: dict[str, Any]) -> list[tuple[str, tuple[int, int]]]:
    return [(n, (e["data_offsets"][0], e["data_offsets"][1])) for n, e in header.items() if n != "__metadata__"]


def misaligned(path: Path, alignment: int = PAGE_BYTES) -> list[TensorExtent]:
    """The tensors of `path` that do not start on an `alignment` boundary."""
    return [e for e in extents(path) if e.offset % alignment]


def align_file(path: Path, alignment: int = PAGE_BYTES) -> None:
    """Rewrites the safetensors file at `path` (written by MLX) so every tensor starts on an `alignment`
    boundary; the tensors' bytes are unchanged. Replaced in one rename: a failure leaves the original."""
    header, data_start = read_header(path)
    meta = header.pop("__metadata__", None)
    order = sorted(header.items(), key=lambda kv: int(kv[1]["data_offsets"][0]))
    # Relative offsets first (the header's length does not depend on them beyond a few digits: iterate).
    layout: dict[str, Any] = {}
    cursor = 0
    for name, entry in order:
        begin, end = (int(x) for x in entry["data_offsets"])
        cursor = -(-cursor // alignment) * alignment
        layout[name] = {**entry, "data_offsets": [cursor, cursor + end - begin]}
        cursor += end - begin
    if meta is not None:
        layout = {"__metadata__": meta, **layout}
    encoded = json.dumps(layout, separators=(",", ":")).encode()
    # Pad the header so the data starts on a boundary: then every relative offset above is absolute-aligned.
    length = -(-(len(encoded) + _HEADER_LEN.size) // alignment) * alignment - _HEADER_LEN.size
    encoded += b" " * (length - len(encoded))
    tmp = path.with_name(f".{path.name}.aligning")
    try:
        with path.open("rb") as src, tmp.open("wb") as dst:
            dst.write(_HEADER_LEN.pack(length) + encoded)
            for name, entry in order:
                begin, end = (int(x) for x in entry["data_offsets"])
                target = _HEADER_LEN.size + length + layout[name]["data_offsets"][0]
                dst.write(b"\0" * (target - dst.tell()))
                src.seek(data_start + begin)
                remaining = end - begin
                while remaining:
                    chunk = src.read(min(remaining, 1 << 24))
                    if not chunk:
                        raise BundleError(f"{path}: tensor {name!r} is cut short")
                    dst.write(chunk)
                    remaining -= len(chunk)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
