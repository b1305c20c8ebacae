"""mlx-lm's attention call site: every model module imports `scaled_dot_product_attention` from
`mlx_lm.models.base` by name and calls it with the layer's cache, so a cache that attends by itself is reached
by rebinding that name in the modules that define a model's layers (a family may reuse another's attention).
Any other cache still goes to mlx-lm's own function."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

DISTRIBUTION = "mlx-lm"
TESTED = ">=0.32.2,<0.33"

Attend = Callable[[Any, Any, float, Any, dict[str, Any]], Any]
"""(cache, queries, scale, mask, the call's other keywords) -> the attention output."""


def route_attention(model: Any, takes: Callable[[Any], bool], attend: Attend) -> bool:
    """Sends the attention of `model`'s layers whose cache `takes` accepts to `attend`; False when the model's
    modules call no `scaled_dot_product_attention` (its attention cannot be routed)."""
    names = {type(m).__module__ for m in model.modules()} | {type(model).__module__}
    modules = [sys.modules[n] for n in sorted(names) if hasattr(sys.modules.get(n), "scaled_dot_product_attention")]
    for module in modules:
        original = module.scaled_dot_product_attention
        if not getattr(original, "_kvrig", False):
            setattr(module, "scaled_dot_product_attention", _routed(original, takes, attend))  # noqa: B010
    return bool(modules)


def _routed(original: Any, takes: Callable[[Any], bool], attend: Attend) -> Any:
    def sdpa(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, **kw: Any) -> Any:
        if takes(cache):
            return attend(cache, queries, scale, mask, kw)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    sdpa._kvrig = True  # type: ignore[attr-defined]
    return sdpa
