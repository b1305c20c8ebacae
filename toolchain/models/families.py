"""Per-family readers: config.json -> the caches mlx-lm really builds for each layer.

Each reader mirrors the `make_cache` (or its absence) of the mlx-lm model of that family; tests build tiny
models with mlx-lm and compare these specs' bytes to MLX's own `nbytes`, so a change in mlx-lm shows up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from toolchain.exceptions import ModelConfigError
from toolchain.models.spec import LayerSpec


class ConfigReader:
    """Typed access to config fields that names the file and field when one is missing or wrong."""

    def __init__(self, config: dict[str, Any], source: str, prefix: str = "") -> None:
        self.config = config
        self.source = source
        self.prefix = prefix

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.config.get(key, default)
        if value is None:
            raise ModelConfigError("missing", file=self.source, field=self._name(key), expected="an integer")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ModelConfigError(
                f"got {value!r}", file=self.source, field=self._name(key), expected=f"an integer >= {minimum}"
            )
        return value

    def opt_integer(self, key: str) -> int | None:
        return None if self.config.get(key) is None else self.integer(key)

    def str_list(self, key: str, length: int, allowed: set[str]) -> list[str]:
        value = self.config.get(key)
        if not isinstance(value, list) or len(value) != length:
            raise ModelConfigError(
                f"got {value!r}" if not isinstance(value, list) else f"has {len(value)} entries",
                file=self.source,
                field=self._name(key),
                expected=f"a list of {length} layer types",
            )
        for i, item in enumerate(value):
            if item not in allowed:
                raise ModelConfigError(
                    f"got {item!r}",
                    file=self.source,
                    field=f"{self._name(key)}[{i}]",
                    expected=" or ".join(sorted(allowed)),
                )
        return value

    def head_dim(self) -> int:
        """`head_dim` when given, else hidden_size / num_attention_heads (as mlx-lm computes it)."""
        if self.config.get("head_dim") is not None:
            return self.integer("head_dim")
        hidden, heads = self.integer("hidden_size"), self.integer("num_attention_heads")
        if hidden % heads:
            raise ModelConfigError(
                f"hidden_size {hidden} is not divisible by num_attention_heads {heads}",
                file=self.source,
                field=self._name("head_dim"),
                expected="an explicit head_dim",
            )
        return hidden // heads

    def kv_heads(self) -> int:
        return self.integer("num_key_value_heads", self.config.get("num_attention_heads"))


def _attention_layers(r: ConfigReader, kinds: list[str], window: int | None) -> list[LayerSpec]:
    kv, hd = r.kv_heads(), r.head_dim()
    return [
        LayerSpec(i, "sliding", kv, hd, hd, window=window)
        if kind == "sliding_attention"
        else LayerSpec(i, "full", kv, hd, hd)
        for i, kind in enumerate(kinds)
    ]


def _all_full(r: ConfigReader) -> list[LayerSpec]:
    n = r.integer("num_hidden_layers")
    return _attention_layers(r, ["full_attention"] * n, None)


def _llama(r: ConfigReader) -> list[LayerSpec]:
    # mlx-lm's llama (also mistral, SmolLM) honours `layer_types` with sliding_attention layers.
    n = r.integer("num_hidden_layers")
    if r.config.get("layer_types") is None:
        return _all_full(r)
    kinds = r.str_list("layer_types", n, {"full_attention", "sliding_attention"})
    window = r.integer("sliding_window") if "sliding_attention" in kinds else None
    return _attention_layers(r, kinds, window)


def _gemma3_text(r: ConfigReader) -> list[LayerSpec]:
    n = r.integer("num_hidden_layers")
    pattern = r.integer("sliding_window_pattern", 6)
    window = r.integer("sliding_window")
    kinds = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(n)]
    return _attention_layers(r, kinds, window)


def _gemma3n(r: ConfigReader) -> list[LayerSpec]:
    n = r.integer("num_hidden_layers")
    shared = r.integer("num_kv_shared_layers", minimum=0)
    kinds = r.str_list("layer_types", n, {"full_attention", "sliding_attention"})
    window = r.integer("sliding_window")
    first_shared = n - shared
    concrete = kinds[:first_shared]
    layers = _attention_layers(r, concrete, window)
    # Shared layers read the cache of the last concrete layer of their own type (mlx-lm layer_idx_to_cache_idx).
    last = {kind: max(i for i, k in enumerate(concrete) if k == kind) for kind in set(concrete)}
    for i in range(first_shared, n):
        if kinds[i] not in last:
            raise ModelConfigError(
                f"shared layer {i} is {kinds[i]} but no earlier layer of that type holds a cache",
                file=r.source,
                field=f"{r.prefix}layer_types",
            )
        layers.append(LayerSpec(i, "shared", source_layer=last[kinds[i]]))
    return layers


def _gemma4(r: ConfigReader) -> list[LayerSpec]:
    """Gemma 4: sliding and global layers with their own KV heads and head dims; global layers may use
    keys as values (stored twice all the same); the last `num_kv_shared_layers` reuse earlier caches.
    Defaults are mlx-lm's gemma4_text ModelArgs defaults, since that is what it builds without them."""
    n = r.integer("num_hidden_layers")
    shared = r.integer("num_kv_shared_layers", 20, minimum=0)
    pattern = r.integer("sliding_window_pattern", 5)
    if r.config.get("layer_types") is None:
        base = ["sliding_attention"] * (pattern - 1) + ["full_attention"]
        r.config = {**r.config, "layer_types": (base * (n // len(base) + 1))[:n]}
    kinds = r.str_list("layer_types", n, {"full_attention", "sliding_attention"})
    window = r.integer("sliding_window", 512)
    head_dim = r.integer("head_dim", 256)
    global_dim = r.integer("global_head_dim", 512) if r.config.get("global_head_dim", 512) else head_dim
    kv = r.integer("num_key_value_heads", 1)
    k_eq_v = bool(r.config.get("attention_k_eq_v", False))
    global_kv = r.integer("num_global_key_value_heads") if k_eq_v and r.config.get("num_global_key_value_heads") else kv
    first_shared = n - shared
    layers: list[LayerSpec] = []
    last: dict[str, int] = {}
    for i, kind in enumerate(kinds):
        if i >= first_shared > 0:
            if kind not in last:
                raise ModelConfigError(
                    f"shared layer {i} is {kind} but no earlier layer of that type holds a cache",
                    file=r.source,
                    field=f"{r.prefix}layer_types",
                )
            layers.append(LayerSpec(i, "shared", source_layer=last[kind]))
            continue
        last[kind] = i
        if kind == "sliding_attention":
            layers.append(LayerSpec(i, "sliding", kv, head_dim, head_dim, window=window))
        else:
            layers.append(LayerSpec(i, "full", global_kv, global_dim, global_dim, keys_as_values=k_eq_v))
    return layers


def _gpt_oss(r: ConfigReader) -> list[LayerSpec]:
    n = r.integer("num_hidden_layers")
    kinds = r.config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    r.config = {**r.config, "layer_types": kinds}
    kinds = r.str_list("layer_types", n, {"full_attention", "sliding_attention"})
    return _attention_layers(r, kinds, r.integer("sliding_window"))


def _hybrid_linear(r: ConfigReader) -> list[LayerSpec]:
    """Qwen3-Next / Qwen3.5: gated DeltaNet layers hold a conv state and a recurrent state; every
    `full_attention_interval`-th layer is full attention."""
    n = r.integer("num_hidden_layers")
    interval = r.integer("full_attention_interval", 4)
    kv, hd = r.kv_heads(), r.integer("head_dim")
    hk, hv = r.integer("linear_num_key_heads"), r.integer("linear_num_value_heads")
    dk, dv = r.integer("linear_key_head_dim"), r.integer("linear_value_head_dim")
    kernel = r.integer("linear_conv_kernel_dim")
    conv_dim = 2 * hk * dk + hv * dv
    # conv state in the activation dtype; the recurrence state is created in float32 (gated_delta.py).
    state = (((1, kernel - 1, conv_dim), None), ((1, hv, dv, dk), "float32"))
    return [
        LayerSpec(i, "linear", state=state) if (i + 1) % interval != 0 else LayerSpec(i, "full", kv, hd, hd)
        for i in range(n)
    ]


def _deepseek_v2(r: ConfigReader) -> list[LayerSpec]:
    # mlx-lm's DeepSeek-V2 expands the latent and caches per-head keys (nope + rope) and values.
    n = r.integer("num_hidden_layers")
    heads = r.integer("num_attention_heads")
    k_dim = r.integer("qk_nope_head_dim") + r.integer("qk_rope_head_dim")
    return [LayerSpec(i, "full", heads, k_dim, r.integer("v_head_dim")) for i in range(n)]


def _deepseek_v3(r: ConfigReader) -> list[LayerSpec]:
    # mlx-lm's DeepSeek-V3 caches the compressed latent (as keys) and the shared rope key (as values).
    n = r.integer("num_hidden_layers")
    latent, rope = r.integer("kv_lora_rank"), r.integer("qk_rope_head_dim")
    return [LayerSpec(i, "latent", 1, latent, rope) for i in range(n)]


Reader = Callable[[ConfigReader], list[LayerSpec]]

# model_type (after mlx-lm's remapping) -> reader. Multimodal wrappers are unwrapped before lookup.
FAMILIES: dict[str, Reader] = {
    "llama": _llama,
    "smollm3": _llama,
    "qwen2": _all_full,
    "qwen3": _all_full,
    "qwen3_moe": _all_full,
    "phi3": _all_full,
    "gemma": _all_full,
    "gemma2": _all_full,  # mlx-lm's gemma2 keeps full caches on its sliding layers (mask only)
    "gemma3_text": _gemma3_text,
    "gemma3n": _gemma3n,
    "gpt_oss": _gpt_oss,
    "gemma4_text": _gemma4,
    "qwen3_next": _hybrid_linear,
    "qwen3_5": _hybrid_linear,
    "qwen3_5_moe": _hybrid_linear,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
}

# Families whose config nests the language model under `text_config`: outer type -> inner type.
TEXT_CONFIG_WRAPPERS: dict[str, str] = {"gemma3": "gemma3_text", "gemma3n": "gemma3n", "gemma4": "gemma4_text"}

# mlx-lm's MODEL_REMAPPING for the families above (kept here so planning never needs mlx-lm).
REMAPPING: dict[str, str] = {"mistral": "llama", "kimi_k2": "deepseek_v3"}

# Families whose mlx-lm attention cannot read a QuantizedKVCache (soft-capping, attention sinks, KV-shared
# layers that hand quantized tuples to plain attention).
NO_QUANTIZED_ATTENTION: set[str] = {"gemma2", "gpt_oss", "gemma4_text"}

NOTES: dict[str, str] = {
    "gpt_oss": "Attention sinks: mlx-lm's quantized attention cannot read quantized KV; kvrig dequantizes on read.",
    "gemma2": "mlx-lm's gemma2 stores full KV on its sliding-window layers too (counted as full), and its "
    "soft-capped attention cannot read quantized KV, so kvrig dequantizes on read.",
    "deepseek_v3": "MLA: mlx-lm caches the latent and rope key unquantized; KV schemes do not apply to it.",
    "gemma3n": "KV-shared layers reuse an earlier layer's cache and hold none of their own.",
    "gemma4_text": "KV-shared layers hold no cache; global layers have their own KV heads and head dim, and "
    "where keys double as values MLX still stores both.",
}
