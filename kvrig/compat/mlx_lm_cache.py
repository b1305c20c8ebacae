"""mlx-lm's base class for KV caches: `mlx_lm.models.cache._BaseCache`.

Caches kvrig defines derive from it so that mlx-lm's models, `make_prompt_cache` helpers and generation loop
treat them as caches (state, meta_state, trim, ...).
"""

from __future__ import annotations

from mlx_lm.models.cache import _BaseCache

DISTRIBUTION = "mlx-lm"
TESTED = ">=0.32.2,<0.33"

BaseCache = _BaseCache
