"""Tiny GGUF files for tests, written with gguf-py's `GGUFWriter` (llama.cpp's own writer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter

# Python value -> GGUF type, as the previous hand-written test files used (int32 unless it needs 64 bits).
_INT, _BIG, _FLOAT, _BOOL, _STR = (
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.FLOAT32,
    GGUFValueType.BOOL,
    GGUFValueType.STRING,
)


def _vtype(v: Any) -> GGUFValueType:
    if isinstance(v, bool):
        return _BOOL
    if isinstance(v, int):
        return _INT if v < 2**31 else _BIG
    if isinstance(v, float):
        return _FLOAT
    if isinstance(v, str):
        return _STR
    raise TypeError(type(v))


def write_gguf(path: Path, metadata: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> Path:
    """F32 tensors only; shapes given row-major (the writer stores them in ggml order)."""
    metadata = dict(metadata)
    writer = GGUFWriter(path, metadata.pop("general.architecture", "llama"))
    for key, value in metadata.items():
        if isinstance(value, list):
            sub = _vtype(value[0]) if value else _INT
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=sub)
        else:
            writer.add_key_value(key, value, _vtype(value))
    for name, arr in (tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
