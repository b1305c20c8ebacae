"""GGUF -> Hugging Face-layout directory (float safetensors, config.json, tokenizer.json) that mlx-lm loads.

MLX reads GGUF tensors itself (Q4_0/Q4_1/Q8_0 come back as MLX affine-quantized arrays with group size 32);
here they are renamed to Hugging Face names, dequantized to the model's float dtype, and llama.cpp's Q/K row
permutation is undone for llama (llama.cpp stores them for its interleaved rope; mlx-lm's llama uses the
half-split layout). The tokenizer is rebuilt from `tokenizer.ggml.*` with the `tokenizers` library.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES

from kvrig.exceptions import ModelConfigError, OutputWriteError, QuantizationError, UnsupportedArchitectureError
from kvrig.models.gguf import GGUFHeader, gguf_config_from_header, read_gguf_header

# llama.cpp's tensor kinds (gguf-py names them; `TENSOR_NAMES` gives each its GGUF name) -> the Hugging Face
# module path mlx-lm loads, inside model.layers.N for per-block tensors.
_T = MODEL_TENSOR
_LAYER_MODULES: dict[str, dict[MODEL_TENSOR, str]] = {
    "common": {
        _T.ATTN_Q: "self_attn.q_proj",
        _T.ATTN_K: "self_attn.k_proj",
        _T.ATTN_V: "self_attn.v_proj",
        _T.ATTN_OUT: "self_attn.o_proj",
        _T.FFN_GATE: "mlp.gate_proj",
        _T.FFN_UP: "mlp.up_proj",
        _T.FFN_DOWN: "mlp.down_proj",
        _T.ATTN_NORM: "input_layernorm",
        _T.FFN_NORM: "post_attention_layernorm",
        _T.ATTN_Q_NORM: "self_attn.q_norm",
        _T.ATTN_K_NORM: "self_attn.k_norm",
    },
    "gemma2": {
        _T.FFN_NORM: "pre_feedforward_layernorm",
        _T.ATTN_POST_NORM: "post_attention_layernorm",
        _T.FFN_POST_NORM: "post_feedforward_layernorm",
    },
    "phi3": {_T.ATTN_QKV: "self_attn.qkv_proj", _T.FFN_UP: "mlp.gate_up_proj"},
}
_GLOBAL_MODULES = {_T.TOKEN_EMBD: "model.embed_tokens", _T.OUTPUT_NORM: "model.norm", _T.OUTPUT: "lm_head"}
_BLOCK_PREFIX = "blk.{bid}."


def _gguf_to_hf(arch: str) -> tuple[dict[str, str], dict[str, str]]:
    """(block suffix -> module, global base -> module) with the GGUF side spelled by gguf-py."""
    table = {**_LAYER_MODULES["common"], **_LAYER_MODULES.get(arch, {})}
    per_block = {TENSOR_NAMES[t].removeprefix(_BLOCK_PREFIX): module for t, module in table.items()}
    return per_block, {TENSOR_NAMES[t]: module for t, module in _GLOBAL_MODULES.items()}


CONVERTIBLE = ["llama", "qwen2", "qwen3", "gemma", "gemma2", "phi3"]
# llama.cpp permutes Q/K rows only for architectures it runs with interleaved ("normal") rope.
_PERMUTED_QK = {"llama"}
# llama.cpp adds 1 to Gemma's RMSNorm weights; mlx-lm's Gemma norm adds the 1 itself.
_NORM_PLUS_ONE = {"gemma", "gemma2"}

# GGUF tensor types MLX can read (it returns the quantized ones as affine 4/8-bit, group 32).
_MLX_READABLE = {"F32": None, "F16": None, "BF16": None, "Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
GGUF_GROUP_SIZE = 32


def hf_tensor_name(arch: str, gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (None for tensors we drop)."""
    base, _, suffix = gguf_name.rpartition(".")
    per_block, global_modules = _gguf_to_hf(arch)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m:
        module = per_block.get(m.group(2))
        return f"model.layers.{m.group(1)}.{module}.{suffix}" if module else None
    # Anything else (e.g. rope_freqs: precomputed rope factors that mlx-lm recomputes from config) is dropped.
    module = global_modules.get(base)
    return f"{module}.{suffix}" if module else None


def _unpermute(w: Any, n_head: int) -> Any:
    """Inverse of llama.cpp's convert permute (rows grouped per head as interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Writes `out_dir` (model.safetensors, config.json, tokenizer.json, tokenizer_config.json); returns the
    config. `out_dir` must not exist or be empty."""
    import mlx.core as mx

    path = Path(path)
    out_dir = Path(out_dir)
    header = read_gguf_header(path)
    config = gguf_config_from_header(header)
    arch = config["model_type"]
    if arch not in CONVERTIBLE:
        raise UnsupportedArchitectureError(arch, CONVERTIBLE, file=path)
    for info in header.tensors.values():
        if info.type_name not in _MLX_READABLE:
            raise QuantizationError(
                f"{path}: tensor '{info.name}' is stored as {info.type_name}; "
                f"converting supports {', '.join(_MLX_READABLE)}"
            )
    try:
        raw = mx.load(str(path))
    except (RuntimeError, ValueError) as exc:
        raise ModelConfigError(f"MLX cannot read the tensors: {exc}", file=path) from None
    assert isinstance(raw, dict)

    dtype = getattr(mx, config["torch_dtype"])
    weights: dict[str, Any] = {}
    for name, info in header.tensors.items():
        hf = hf_tensor_name(arch, name)
        if hf is None:
            continue
        bits = _MLX_READABLE[info.type_name]
        if bits is None:
            w = raw[name]
        else:
            stem = name.removesuffix(".weight")
            w = mx.dequantize(
                raw[name], raw[f"{stem}.scales"], raw[f"{stem}.biases"], group_size=GGUF_GROUP_SIZE, bits=bits
            )
        if arch in _PERMUTED_QK and re.search(r"\.attn_[qk]\.(weight|bias)$", name):
            heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
            w = _unpermute(w, heads)
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            w = w - 1
        weights[hf] = w.astype(dtype)
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.eval(weights)  # computed here, so a RuntimeError from the save below is the write's
    try:
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    except RuntimeError as exc:  # MLX reports a failed write (disk full) without an errno
        raise OutputWriteError(f"{out_dir / 'model.safetensors'}: cannot write the converted model: {exc}") from None
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(header, out_dir)
    return config


# --- tokenizer ------------------------------------------------------------------------------------------

# llama.cpp pre-tokenizer names -> the split regex of the original tokenizer (llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str, file: Path) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre in ("gpt2", "default", "smollm", "starcoder", "refact"):
        steps: list[Any] = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre in ("smollm", "starcoder", "refact"):
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        return pre_tokenizers.Sequence(steps)
    if pre in ("llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen"):
        split = _QWEN2_SPLIT if pre.startswith(("qwen2", "deepseek")) else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelConfigError(
        f"unknown pre-tokenizer '{pre}'",
        file=file,
        field="tokenizer.ggml.pre",
        expected="one of gpt2, smollm, starcoder, llama-bpe, qwen2",
    )


def write_tokenizer(header: GGUFHeader, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat template kept) from the GGUF's tokenizer metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    md = header.metadata
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelConfigError(
            f"tokenizer model '{kind}' cannot be rebuilt from GGUF yet",
            file=header.path,
            field="tokenizer.ggml.model",
            expected="'gpt2' (byte-level BPE); for others package the Hugging Face directory instead",
        )
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    merges_raw: list[str] = md.get("tokenizer.ggml.merges", [])
    types: list[int] = md.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [(a, b) for a, _, b in (m.partition(" ") for m in merges_raw)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(md.get("tokenizer.ggml.pre", "gpt2")), header.path)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(t, special=ty == _TOKEN_TYPE_CONTROL, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])

    def special(key: str) -> str | None:
        idx = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos = special("bos")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out_dir / "tokenizer.json"))

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get(f"{header.architecture}.context_length", 2048)),
    }
    for key in ("bos", "eos", "unknown", "padding"):
        value = special(key)
        if value is not None:
            name = {"unknown": "unk", "padding": "pad"}.get(key, key)
            tok_config[f"{name}_token"] = value
    template = md.get("tokenizer.chat_template")
    if isinstance(template, str):
        tok_config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
