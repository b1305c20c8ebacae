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
    modules call no `scaled_dot_product_attention` (its attention cannot be routed). A module is wrapped once; each
    route (`takes`, `attend`: pass the same functions again, not new lambdas) is added to it once."""
    names = {type(m).__module__ for m in model.modules()} | {type(model).__module__}
    modules = [sys.modules[n] for n in sorted(names) if hasattr(sys.modules.get(n), "scaled_dot_product_attention")]
    for module in modules:
        routed = module.scaled_dot_product_attention
        if not hasattr(routed, "kvrig_routes"):
            routed = _routed(routed)
            setattr(module, "scaled_dot_product_attention", routed)  # noqa: B010
        if (takes, attend) not in routed.kvrig_routes:
            routed.kvrig_routes.append((takes, attend))
    return bool(modules)


def _routed(original: Any) -> Any:
    routes: list[tuple[Callable[[Any], bool], Attend]] = []

    def sdpa(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, **kw: Any) -> Any:
        for takes, attend in routes:
            if takes(cache):
                return attend(cache, queries, scale, mask, kw)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    sdpa.kvrig_routes = routes  # type: ignore[attr-defined]
    return sdpa
