"""The real mlx-lm model for a config, built lazily: MLX allocates nothing until arrays are evaluated, so even
a large model costs only its graph. Used for exact parameter shapes (counts, quantized bytes)."""

from __future__ import annotations

from typing import Any

from toolchain.exceptions import UnsupportedArchitectureError
from toolchain.models.families import FAMILIES


def build_lazy_model(config: dict[str, Any]) -> Any:
    """The mlx-lm model for `config`, with unevaluated (unallocated) parameters."""
    from mlx_lm.utils import _get_classes

    try:
        model_cls, args_cls = _get_classes(config)
    except ValueError:
        raise UnsupportedArchitectureError(str(config.get("model_type")), list(FAMILIES)) from None
    return model_cls(args_cls.from_dict(config))


def count_parameters(config: dict[str, Any], model: Any = None) -> int:
    from mlx.utils import tree_flatten

    model = model if model is not None else build_lazy_model(config)
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return sum(p.size for _, p in flat)
