"""What a model's config claims, held to what a model can be before anything is built from it.

Planning builds the mlx-lm model lazily from the config: one module per claimed layer, arrays of the claimed
shapes, cache replays up to the claimed context. A config from anywhere can claim ten million layers or a
context of 1e15 tokens, and memory and time would follow the claim. So every size a model is built from must be
a whole number in a range no real model leaves (the largest today are a few hundred layers, 10M positions, a
few hundred thousand vocabulary entries), checked where configs are read; out of range is ModelConfigError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from kvrig.exceptions import ModelConfigError

# field -> the largest value accepted (every one at least 1).
LIMITS: Final[dict[str, int]] = {
    "num_hidden_layers": 1024,
    "max_position_embeddings": 1 << 24,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "moe_intermediate_size": 1 << 20,
    "vocab_size": 1 << 22,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12,
    "num_experts": 1 << 12,
    "num_local_experts": 1 << 12,
    "n_routed_experts": 1 << 12,
}


def check_claims(config: dict[str, Any], source: str | Path) -> None:
    """Refuses a config (or its `text_config`) whose sizes are not whole numbers within LIMITS."""
    for prefix, part in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(part, dict):
            continue
        for field, largest in LIMITS.items():
            value = part.get(field)
            for one in value if isinstance(value, list) else [value]:  # some families give one per layer
                _check(one, prefix + field, largest, source)


def _check(value: Any, field: str, largest: int, source: str | Path) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelConfigError(
            f"got {value!r}", file=source, field=field, expected=f"a whole number from 1 to {largest}"
        )
    if not 1 <= value <= largest:
        raise ModelConfigError(
            f"claims {value}, " + ("not a size" if value < 1 else "beyond what any model has"),
            file=source,
            field=field,
            expected=f"a whole number from 1 to {largest}",
        )
