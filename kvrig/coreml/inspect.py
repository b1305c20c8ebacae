"""Read a saved .mlpackage back from disk: its interface (inputs, outputs, states), op counts and the weight
constants actually stored in weight.bin. The export reports this, not what it meant to write."""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import Field

from kvrig.exceptions import CoreMLExportError
from kvrig.schemas import StrictModel

WEIGHTS_FILE = Path("Data/com.apple.CoreML/weights/weight.bin")
_BLOB_SENTINEL = 0xDEADBEEF


class Feature(StrictModel):
    name: str
    dtype: str
    shape: list[int]
    range: list[list[int]] | None = Field(default=None, description="[lower, upper] per dim when flexible")


class PackageInfo(StrictModel):
    inputs: list[Feature]
    outputs: list[Feature]
    states: list[Feature]
    functions: list[str]
    op_counts: dict[str, int]
    weight_blobs: int
    weight_blob_bytes: int = Field(description="data bytes of every constant stored in weight.bin")
    weight_blob_dtypes: dict[str, int] = Field(description="MIL dtype name -> data bytes in weight.bin")
    weight_file_bytes: int


def _feature(desc: Any, kind: str) -> Feature:
    from coremltools.proto import FeatureTypes_pb2

    array = desc.type.stateType.arrayType if kind == "state" else desc.type.multiArrayType
    dtype = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(array.dataType)
    ranges = [[r.lowerBound, r.upperBound] for r in array.shapeRange.sizeRanges] or None
    return Feature(name=desc.name, dtype=dtype.lower(), shape=list(array.shape), range=ranges)


def _records(weight_file: Path) -> dict[int, tuple[int, int]]:
    """offset of each record -> (MIL dtype code, data bytes), walking the file as coremltools lays it out."""
    data = weight_file.read_bytes()
    out: dict[int, tuple[int, int]] = {}
    offset = 64
    while offset < len(data):
        sentinel, dtype, size, start = struct.unpack_from("<IIQQ", data, offset)
        if sentinel != _BLOB_SENTINEL:
            raise CoreMLExportError(f"{weight_file}: no weight record at byte {offset}")
        out[offset] = (dtype, size)
        offset = -(-(start + size) // 64) * 64
    return out


def inspect_package(path: Path) -> PackageInfo:
    import coremltools as ct
    from coremltools.proto import MIL_pb2

    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    weight_file = path / WEIGHTS_FILE
    records = _records(weight_file) if weight_file.is_file() else {}
    ops: Counter[str] = Counter()
    blob_dtypes: Counter[str] = Counter()
    used: set[int] = set()
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            for op in block.operations:
                ops[op.type] += 1
                # Constants live in const ops and, for constexpr ops, in the op's own attributes.
                values = [(k, v) for k, v in op.attributes.items()]
                values += [(k, arg.value) for k, x in op.inputs.items() for arg in x.arguments if arg.HasField("value")]
                for key, value in values:
                    if not value.HasField("blobFileValue"):
                        continue
                    offset = value.blobFileValue.offset
                    if offset not in records:
                        raise CoreMLExportError(f"{weight_file}: constant '{op.outputs[0].name}.{key}' has no record")
                    if offset not in used:
                        used.add(offset)
                        dtype = MIL_pb2.DataType.Name(value.type.tensorType.dataType).lower()
                        blob_dtypes[dtype] += records[offset][1]
    return PackageInfo(
        inputs=[_feature(d, "input") for d in spec.description.input],
        outputs=[_feature(d, "output") for d in spec.description.output],
        states=[_feature(d, "state") for d in spec.description.state],
        functions=sorted(spec.mlProgram.functions),
        op_counts=dict(sorted(ops.items())),
        weight_blobs=len(used),
        weight_blob_bytes=sum(blob_dtypes.values()),
        weight_blob_dtypes=dict(blob_dtypes),
        weight_file_bytes=weight_file.stat().st_size if weight_file.is_file() else 0,
    )
