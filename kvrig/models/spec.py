"""ModelSpec: a model's layers and caches as mlx-lm really builds them, learned from the model itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrig.exceptions import ModelConfigError
from kvrig.kvcache.families import NO_QUANTIZED_ATTENTION
from kvrig.models.layers import LayerKind, LayerSpec
from kvrig.models.lazy import build_lazy_model, cast_model, copy_modules, count_parameters
from kvrig.models.probe import CacheProbe


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
    notes: list[str] = field(default_factory=list)
    """facts about how MLX stores this model that a user should know."""
    tensors: dict[str, tuple[tuple[int, ...], str]] | None = None
    """the checkpoint's tensor names -> (shape, dtype) when planned from a folder (they decide the tie)."""
    _probes: dict[str, Any] = field(default_factory=dict, repr=False)
    _weights: dict[str, Any] = field(default_factory=dict, repr=False)
    _parameters: int | None = field(default=None, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def lazy_model(self, dtype: str | None = None) -> Any:
        """A fresh lazily built mlx-lm model (cast like mlx-lm's convert when `dtype` is given)."""

        model = build_lazy_model(self.config, self.tensors, self.source)
        return cast_model(model, dtype) if dtype else model

    def weights_model(self, dtype: str) -> Any:
        """A copy of the lazily built model cast to `dtype`, to quantize in place (built and cast once)."""

        if dtype not in self._weights:
            self._weights[dtype] = self.lazy_model(dtype)
        return copy_modules(self._weights[dtype])

    def probe(self, dtype: str = "float16") -> Any:
        """The model's own caches learned from one lazy step in `dtype` (see plan/caches.py)."""
        if dtype not in self._probes:
            try:
                self._probes[dtype] = CacheProbe(self.lazy_model(dtype), dtype)
            except ModelConfigError as exc:
                if exc.file is not None:
                    raise
                # the probe knows the model, not where its config came from
                raise ModelConfigError(str(exc), file=self.source) from None
        return self._probes[dtype]

    @property
    def quantized_attention(self) -> bool:
        """Whether kvrig's runtime hands this model mlx-lm's QuantizedKVCache (else its dequantize-on-read
        cache): the runtime's own rule, so plan and runtime agree."""

        return self.model_type not in NO_QUANTIZED_ATTENTION

    def parameter_count(self) -> int:
        """Parameters of the mlx-lm model for this config (built lazily; imports MLX)."""

        if self._parameters is None:
            self._parameters = count_parameters(self.config, self.lazy_model())
        return self._parameters

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
