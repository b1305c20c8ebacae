"""GGUF header reading on the real SmolLM2 GGUF (expected values from MLX's own GGUF loader) and on tiny
GGUF files written here."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvrig.exceptions import ModelConfigError, UnsupportedArchitectureError
from kvrig.models.gguf import embedded_default_model, read_gguf_config, read_gguf_header
from tests.gguf_writer import write_gguf


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return embedded_default_model()


@pytest.fixture(scope="module")
def mlx_view(smollm2: Path) -> tuple[dict, dict]:
    return mx.load(str(smollm2), return_metadata=True)


def _int(v: mx.array) -> int:
    return int(v.item())


def test_smollm2_config_matches_mlx_reader(smollm2: Path, mlx_view: tuple[dict, dict]) -> None:
    weights, meta = mlx_view
    cfg = read_gguf_config(smollm2)
    assert cfg["model_type"] == meta["general.architecture"] == "llama"
    assert cfg["hidden_size"] == _int(meta["llama.embedding_length"])
    assert cfg["num_hidden_layers"] == _int(meta["llama.block_count"])
    assert cfg["num_attention_heads"] == _int(meta["llama.attention.head_count"])
    assert cfg["num_key_value_heads"] == _int(meta["llama.attention.head_count_kv"])
    assert cfg["intermediate_size"] == _int(meta["llama.feed_forward_length"])
    assert cfg["max_position_embeddings"] == _int(meta["llama.context_length"])
    assert cfg["rope_theta"] == pytest.approx(meta["llama.rope.freq_base"].item())
    assert cfg["rms_norm_eps"] == pytest.approx(meta["llama.attention.layer_norm_rms_epsilon"].item())
    # Dims from tensor shapes, not metadata: MLX unpacks Q4_1 as uint32 words of 8 values each.
    n_layers = len({k.split(".")[1] for k in weights if k.startswith("blk.")})
    assert cfg["num_hidden_layers"] == n_layers
    q_rows = weights["blk.0.attn_q.weight"].shape[0]
    k_rows = weights["blk.0.attn_k.weight"].shape[0]
    assert cfg["num_attention_heads"] * cfg["head_dim"] == q_rows
    assert cfg["num_key_value_heads"] * cfg["head_dim"] == k_rows
    assert cfg["intermediate_size"] == weights["blk.0.ffn_gate.weight"].shape[0]
    assert cfg["vocab_size"] == len(meta["tokenizer.ggml.tokens"])
    assert cfg["tie_word_embeddings"] is ("output.weight" not in weights)
    # Published SmolLM2-135M numbers (its Hugging Face config.json).
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        576,
        30,
        3,
        64,
    )


def test_header_tensor_infos_cover_the_file(smollm2: Path, mlx_view: tuple[dict, dict]) -> None:
    header = read_gguf_header(smollm2)
    weights, _ = mlx_view
    # Every MLX weight comes from one GGUF tensor (quantized ones add .scales/.biases).
    assert {k for k in weights if not k.endswith((".scales", ".biases"))} == set(header.tensors)
    norm = header.tensors["blk.0.attn_norm.weight"]
    assert norm.shape == tuple(weights["blk.0.attn_norm.weight"].shape)
    # The last tensor ends exactly at the end of the file.
    last = max(header.tensors.values(), key=lambda t: t.offset)
    assert last.nbytes is not None
    assert header.data_offset + last.offset + last.nbytes == os.path.getsize(smollm2)


def test_tiny_gguf_roundtrip(tmp_path: Path) -> None:
    md = {
        "general.architecture": "qwen2",
        "qwen2.embedding_length": 64,
        "qwen2.block_count": 2,
        "qwen2.feed_forward_length": 128,
        "qwen2.attention.head_count": 4,
        "qwen2.attention.head_count_kv": 2,
        "qwen2.context_length": 512,
        "qwen2.rope.freq_base": 1000000.0,
        "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.tokens": ["a", "b", "c"],
    }
    path = write_gguf(tmp_path / "tiny.gguf", md, {"token_embd.weight": np.zeros((3, 64))})
    cfg = read_gguf_config(path)
    assert cfg["model_type"] == "qwen2"
    assert cfg["head_dim"] == 16
    assert cfg["num_key_value_heads"] == 2
    assert cfg["vocab_size"] == 3
    assert cfg["rms_norm_eps"] == 1e-6
    assert cfg["tie_word_embeddings"] is True
    assert read_gguf_header(path).tensors["token_embd.weight"].shape == (3, 64)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "odd.gguf", {"general.architecture": "mamba9", "mamba9.block_count": 2})
    with pytest.raises(UnsupportedArchitectureError) as info:
        read_gguf_config(path)
    assert info.value.architecture == "mamba9"
    assert "llama" in info.value.supported
    assert str(path) in str(info.value)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama"}')
    with pytest.raises(ModelConfigError, match="not a GGUF file") as info:
        read_gguf_config(path)
    assert info.value.file == str(path)


def test_truncated_gguf(tmp_path: Path, smollm2: Path) -> None:
    path = tmp_path / "cut.gguf"
    with smollm2.open("rb") as fh:
        path.write_bytes(fh.read(5000))  # inside the tokenizer arrays
    with pytest.raises(ModelConfigError, match="truncated") as info:
        read_gguf_header(path)
    assert info.value.file == str(path)


def test_corrupt_length(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "ok.gguf", {"general.architecture": "llama"})
    data = bytearray(path.read_bytes())
    data[24:32] = (2**62).to_bytes(8, "little")  # length of the first key
    path.write_bytes(bytes(data))
    with pytest.raises(ModelConfigError, match="corrupt"):
        read_gguf_header(path)


def test_missing_required_field(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "half.gguf", {"general.architecture": "llama", "llama.block_count": 2})
    with pytest.raises(ModelConfigError, match=r"llama\.embedding_length"):
        read_gguf_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="not found"):
        read_gguf_config(tmp_path / "nope.gguf")


def _gguf_py_view(path: Path) -> tuple[dict, dict, int]:
    """The header as llama.cpp's own reader (gguf-py's GGUFReader) reads it: the independent reference."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    metadata = {}
    for key, fld in reader.fields.items():
        if not key.startswith("GGUF."):
            value = fld.contents()
            metadata[key] = pytest.approx(value) if fld.types == [GGUFValueType.FLOAT32] else value
    tensors = {t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), int(t.tensor_type)) for t in reader.tensors}
    offsets = {t.name: int(t.data_offset) - int(reader.data_offset) for t in reader.tensors}
    return metadata, {n: (*tensors[n], offsets[n]) for n in tensors}, int(reader.data_offset)


def _kvrig_view(path: Path) -> tuple[dict, dict, int]:
    header = read_gguf_header(path)
    tensors = {t.name: (t.shape, t.ggml_type, t.offset) for t in header.tensors.values()}
    return header.metadata, tensors, header.data_offset


def test_the_header_is_what_gguf_py_reads_on_smollm2(smollm2: Path) -> None:
    assert _kvrig_view(smollm2) == _gguf_py_view(smollm2)


def test_every_value_type_is_what_gguf_py_reads(tmp_path: Path) -> None:
    from gguf import GGUFValueType, GGUFWriter

    path = tmp_path / "types.gguf"
    writer = GGUFWriter(path, "llama")
    scalars = {
        GGUFValueType.UINT8: 200,
        GGUFValueType.INT8: -100,
        GGUFValueType.UINT16: 60000,
        GGUFValueType.INT16: -30000,
        GGUFValueType.UINT32: 4_000_000_000,
        GGUFValueType.INT32: -2_000_000_000,
        GGUFValueType.FLOAT32: 1e-5,
        GGUFValueType.BOOL: True,
        GGUFValueType.STRING: "Ünïcode ✓",
        GGUFValueType.UINT64: 2**63 + 5,
        GGUFValueType.INT64: -(2**62),
        GGUFValueType.FLOAT64: 0.1,
    }
    for vtype, value in scalars.items():
        writer.add_key_value(f"test.{vtype.name.lower()}", value, vtype)
        sub = [value, value] if vtype != GGUFValueType.STRING else ["a", "", "ü"]
        writer.add_key_value(f"test.{vtype.name.lower()}s", sub, GGUFValueType.ARRAY, sub_type=vtype)
    writer.add_key_value("general.alignment", 64, GGUFValueType.UINT32)
    writer.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b.weight", np.ones((5,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, reference = _kvrig_view(path), _gguf_py_view(path)
    assert ours == reference and ours[2] % 64 == 0
    assert ours[0]["test.float32"] == 1e-05  # the shortest decimal of the float32, as config.json shows it


def test_a_cut_inside_the_tensor_data_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "ok.gguf", {"general.architecture": "llama"}, {"w.weight": np.ones((64, 64))})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelConfigError, match=r"truncated or corrupt .*w\.weight"):
        read_gguf_header(cut)
