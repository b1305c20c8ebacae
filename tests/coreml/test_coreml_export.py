"""The saved Core ML package, read back with coremltools, against independent sources: the bundle's config.json,
MLX's own nbytes and mx.dequantize of the bundle's weights, and the file on disk."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvrig.coreml.export import ExportResult
from kvrig.planner.coreml import plan_coreml_model
from tests.coreml.conftest import SMOL_CONTEXT, TINY, load_program

WEIGHT_BIN = Path("Data/com.apple.CoreML/weights/weight.bin")
BITS = {"uint4": 4, "uint8": 8, "fp16": 16, "fp32": 32}


def _bundle_tensors(bundle: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(bundle.glob("*.safetensors")):
        out.update(mx.load(str(f)))  # type: ignore[arg-type]
    return out


def _const_values(prog) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {op.outputs[0].name: op.outputs[0].val for op in prog.functions["main"].operations if op.op_type == "const"}


def _dtype_name(var) -> str:  # type: ignore[no-untyped-def]
    from coremltools.converters.mil.mil import types

    return types.builtin_to_string(var.dtype)


def _weight_constants(prog) -> list:  # type: ignore[no-untyped-def]
    """Constants big enough to be weights (coremltools writes these to weight.bin; op parameters are tiny)."""
    return [
        op.outputs[0]
        for op in prog.functions["main"].operations
        if op.op_type == "const" and np.size(op.outputs[0].val) >= 10
    ]


def test_interface_is_what_the_bundle_config_says(smol_export: ExportResult, smol_bundle: Path) -> None:
    import coremltools as ct

    cfg = json.loads((smol_bundle / "config.json").read_text())
    spec = ct.models.MLModel(smol_export.output, skip_model_load=True).get_spec()
    assert spec.specificationVersion >= 9  # iOS 18: the first with states
    inputs = {i.name: i.type.multiArrayType for i in spec.description.input}
    assert list(inputs) == ["input_ids", "position"]
    ids = inputs["input_ids"]
    assert [(r.lowerBound, r.upperBound) for r in ids.shapeRange.sizeRanges] == [(1, 1), (1, SMOL_CONTEXT)]
    assert ids.dataType == ct.proto.FeatureTypes_pb2.ArrayFeatureType.INT32
    (out,) = spec.description.output
    assert out.name == "logits" and list(out.type.multiArrayType.shape) == [1, cfg["vocab_size"]]
    states = spec.description.state
    assert len(states) == 2 * cfg["num_hidden_layers"]
    shape = [1, cfg["num_key_value_heads"], SMOL_CONTEXT, cfg["head_dim"]]
    for s in states:
        array = s.type.stateType.arrayType
        assert list(array.shape) == shape
        assert array.dataType == ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT16
    assert {s.name for s in states} == {f"{k}_{i}" for i in range(cfg["num_hidden_layers"]) for k in ("keys", "values")}
    assert smol_export.context_source == "--context"


def test_ops_and_weight_dtypes(smol_export: ExportResult, smol_bundle: Path) -> None:
    prog = load_program(Path(smol_export.output))
    ops = Counter(op.op_type for op in prog.functions["main"].operations)
    tensors = _bundle_tensors(smol_bundle)
    quantized = [k.removesuffix(".scales") for k in tensors if k.endswith(".scales")]
    layers = json.loads((smol_bundle / "config.json").read_text())["num_hidden_layers"]
    # One block-wise constexpr per quantized matrix in the bundle (tied lm_head reuses the embedding's).
    assert ops["constexpr_blockwise_shift_scale"] == len(quantized) == 7 * layers + 1
    assert ops["read_state"] == ops["coreml_update_state"] == ops["slice_update"] == 2 * layers
    assert ops["softmax"] == layers
    assert not {"linear", "constexpr_affine_dequantize", "conv"} & set(ops)
    for op in prog.functions["main"].operations:
        if op.op_type == "constexpr_blockwise_shift_scale":
            assert _dtype_name(op.data) == "uint4" and _dtype_name(op.scale) == "fp16"
            assert op.offset is None
    # What the export reports, read from the saved proto (where the state write is called write_state).
    reported = smol_export.package.op_counts
    assert reported["write_state"] == reported["read_state"] == ops["read_state"]
    assert reported["constexpr_blockwise_shift_scale"] == ops["constexpr_blockwise_shift_scale"]
    assert {k: v for k, v in reported.items() if k not in ("const", "write_state")} == {
        k: v for k, v in ops.items() if k not in ("const", "coreml_update_state")
    }


def _check_bytes(result: ExportResult, bundle: Path) -> None:
    cfg = json.loads((bundle / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope_bytes = head_dim // 2 * 4
    # MLX's own bytes for every tensor of the bundle, plus the one fp32 RoPE table the program adds.
    mlx_bytes = sum(v.nbytes for v in _bundle_tensors(bundle).values())
    # `kvrig plan BUNDLE --backend coreml`: the bundle as it is quantized, a mixed recipe's layers their own way.
    plan = plan_coreml_model(bundle, "iPhone16,1", weights="auto", group_size=64, contexts=[8])
    assert plan.weights_bytes == mlx_bytes + rope_bytes
    prog = load_program(Path(result.output))
    read_back = sum(np.size(v.val) * BITS[_dtype_name(v)] // 8 for v in _weight_constants(prog))
    assert read_back == plan.weights_bytes
    assert (Path(result.output) / WEIGHT_BIN).stat().st_size == plan.weight_file_bytes
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    assert plan.state_bytes_per_token == per_token
    assert sum(int(np.prod(s.shape)) * 2 for s in result.package.states) == per_token * result.context


def test_smollm2_weight_bytes_equal_the_plan(smol_export: ExportResult, smol_bundle: Path) -> None:
    import coremltools as ct

    _check_bytes(smol_export, smol_bundle)
    # `kvrig plan --backend coreml` on the source GGUF predicts the same program.
    plan = plan_coreml_model(None, "iPhone16,1", weights="q4", group_size=64, contexts=[SMOL_CONTEXT])
    assert plan.weight_file_bytes == (Path(smol_export.output) / WEIGHT_BIN).stat().st_size
    # The KV states the saved program declares (float16), read back by coremltools.
    spec = ct.models.MLModel(smol_export.output, skip_model_load=True).get_spec()
    states = [s.type.stateType.arrayType for s in spec.description.state]
    assert states and all(a.dataType == ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT16 for a in states)
    assert plan.state_bytes[SMOL_CONTEXT] == sum(int(np.prod(a.shape)) * 2 for a in states)


def _check_dequantized(result: ExportResult, bundle: Path) -> tuple[int, set[int]]:
    prog = load_program(Path(result.output))
    consts = _const_values(prog)
    tensors = _bundle_tensors(bundle)
    quant = json.loads((bundle / "config.json").read_text())["quantization"]
    checked, groups = 0, set()
    for op in prog.functions["main"].operations:
        if op.op_type != "constexpr_blockwise_shift_scale":
            continue
        name = op.name.removesuffix("_dequantized")
        stem = next(
            k.removesuffix(".scales") for k in tensors if k.endswith(".scales") and k[:-7].replace(".", "_") == name
        )
        q, s = op.data.val.astype(np.float16), op.scale.val
        b = consts[f"{name}_biases"]
        group = q.shape[1] // s.shape[1]
        own = quant.get(stem) if isinstance(quant.get(stem), dict) else quant  # a mixed recipe's layer: its own
        groups.add(own["group_size"])
        # Core ML's s·q, then the group bias the program adds, in MLX's fp16 order of rounding.
        ours = (np.repeat(s, group, axis=1) * q).astype(np.float16) + np.repeat(b, group, axis=1)
        ref = mx.dequantize(
            tensors[f"{stem}.weight"],
            tensors[f"{stem}.scales"],
            tensors[f"{stem}.biases"],
            group_size=own["group_size"],
            bits=own["bits"],
        )
        np.testing.assert_array_equal(ours, np.array(ref))
        checked += 1
    return checked, groups


def test_smollm2_dequantized_constants_are_the_bundle_weights(smol_export: ExportResult, smol_bundle: Path) -> None:
    layers = json.loads((smol_bundle / "config.json").read_text())["num_hidden_layers"]
    assert _check_dequantized(smol_export, smol_bundle) == (7 * layers + 1, {64})
    # Unquantized vectors (norms) are the bundle's fp16 values, bit for bit.
    consts = _const_values(load_program(Path(smol_export.output)))
    tensors = _bundle_tensors(smol_bundle)
    np.testing.assert_array_equal(consts["model_norm_weight"], np.array(tensors["model.norm.weight"]))


@pytest.mark.parametrize("name", list(TINY))
def test_other_families(name: str, tiny_exports: dict[str, ExportResult]) -> None:
    result = tiny_exports[name]
    bundle = Path(result.bundle)
    model_type, weights, extra = TINY[name]
    assert result.model_type == model_type
    assert result.context == 64 and result.context_source == "kvcache.json"
    _check_bytes(result, bundle)
    untied = extra.get("tie_word_embeddings") is False
    checked, groups = _check_dequantized(result, bundle)
    assert checked == 7 * 2 + 1 + untied
    assert groups == ({32, 64} if weights.startswith("gpx-") else {64})  # the mixed layout keeps its groups
    dtypes = {
        _dtype_name(op.data)
        for op in load_program(Path(result.output)).functions["main"].operations
        if op.op_type == "constexpr_blockwise_shift_scale"
    }
    assert dtypes == {f"uint{json.loads((bundle / 'config.json').read_text())['quantization']['bits']}"}
