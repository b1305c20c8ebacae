"""A tiny GGUF writer for tests: writes the format from its specification (header, metadata, tensor infos,
aligned data), independently of the reader under test."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(v: Any) -> bytes:
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        return struct.pack("<Ii", 5, v) if v < 2**31 else struct.pack("<IQ", 10, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    if isinstance(v, list):
        if v and isinstance(v[0], str):
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_string(x) for x in v)
        return struct.pack("<IIQ", 9, 5, len(v)) + b"".join(struct.pack("<i", x) for x in v)
    raise TypeError(type(v))


def write_gguf(path: Path, metadata: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> Path:
    """F32 tensors only; shapes given row-major, stored in ggml order (innermost first)."""
    tensors = tensors or {}
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _string(key) + _value(value)
    offset = 0
    blobs = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        out += _string(name) + struct.pack("<I", arr.ndim)
        out += b"".join(struct.pack("<Q", d) for d in reversed(arr.shape))
        out += struct.pack("<IQ", 0, offset)
        blob = arr.tobytes()
        blob += b"\0" * (-len(blob) % 32)
        blobs.append(blob)
        offset += len(blob)
    out += b"\0" * (-len(out) % 32)
    for blob in blobs:
        out += blob
    path.write_bytes(bytes(out))
    return path
