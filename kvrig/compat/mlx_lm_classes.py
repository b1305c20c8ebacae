"""mlx-lm's (Model, ModelArgs) lookup for a config: `mlx_lm.utils._get_classes`.

mlx-lm has no public name for it; `load_model` uses it after reading weights, and kvrig needs the classes
without any weights (to build lazy models for planning).
"""

from __future__ import annotations

from typing import Any

DISTRIBUTION = "mlx-lm"
TESTED = ">=0.32.2,<0.33"


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """(Model, ModelArgs) for a Hugging Face config, with mlx-lm's own model-type remapping."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)
