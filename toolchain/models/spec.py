"""ModelSpec: what a model's caches look like, layer by layer, as the MLX implementation stores them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

LayerKind = Literal["full", "sliding", "shared", "linear", "latent"]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's cache.

    full/sliding: keys (kv_heads × k_head_dim) and values (kv_heads × v_head_dim) per token; sliding layers
    keep a ring of `window` tokens. latent (MLA): the compressed latent is stored as "keys" and the rope
    part as "values", one head each. shared: reuses `source_layer`'s cache, stores nothing. linear: a
    constant recurrent state, `state` lists each array's (shape, dtype); dtype None means the activation dtype.
    """

    index: int
    kind: LayerKind
    kv_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    window: int | None = None
    source_layer: int | None = None
    state: tuple[tuple[tuple[int, ...], str | None], ...] = ()
    keys_as_values: bool = False
    """the layer's keys double as values (no v_proj) yet MLX still stores both arrays."""

    @property
    def grows(self) -> bool:
        return self.kind in ("full", "latent")


@dataclass
class ModelSpec:
    model_type: str
    """mlx-lm's model type (after its remapping, e.g. mistral -> llama)."""
    source: str
    """where the config came from (file path)."""
    config: dict[str, Any]
    """the full config as read; for multimodal models this still holds `text_config`."""
    layers: list[LayerSpec]
    dtype: str = "float16"
    """the checkpoint's dtype as declared (torch_dtype); the plan uses the phone's activation dtype."""
    hidden_size: int = 0
    vocab_size: int = 0
    quantized_attention: bool = True
    """whether mlx-lm's quantized attention can read this model's KV (else kvrig dequantizes on read)."""
    notes: list[str] = field(default_factory=list)
    """facts about how MLX stores this model that a user should know (e.g. sliding layers kept full)."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def parameter_count(self) -> int:
        """Parameters of the mlx-lm model for this config (built lazily; imports MLX)."""
        from toolchain.models.lazy import count_parameters

        return count_parameters(self.config)

    def count(self, kind: LayerKind) -> int:
        return sum(1 for layer in self.layers if layer.kind == kind)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "source": self.source,
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "layers": [
                {k: v for k, v in vars(layer).items() if v not in (None, (), 0) or k in ("index", "kind")}
                for layer in self.layers
            ],
            "notes": self.notes,
        }
