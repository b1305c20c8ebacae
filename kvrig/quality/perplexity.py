"""Perplexity by direct forward passes through the prompt caches (teacher forcing, chunk by chunk), so
every token is read back through the KV scheme under test exactly as generation would read it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PerplexityResult:
    ppl: float
    tokens: int
    kv_bytes: dict[int, int] = field(default_factory=dict)
    """Cache bytes (sum of every cache's nbytes) after the chunk that reached each context."""


def perplexity(
    model: Any,
    tokens: list[int],
    caches: list[Any],
    *,
    chunk: int = 256,
    contexts: tuple[int, ...] = (),
    after_chunk: Callable[[list[Any]], None] | None = None,
) -> PerplexityResult:
    """exp(mean NLL) of tokens[1:] given their prefixes. The caches start empty; `contexts` are the offsets at
    which the caches' bytes are recorded (they must fall on chunk boundaries)."""
    import mlx.core as mx

    if len(tokens) < 2:
        raise ValueError("perplexity needs at least two tokens")
    ids = mx.array(tokens)
    total = mx.array(0.0, dtype=mx.float32)
    n = len(tokens) - 1
    seen: dict[int, int] = {}
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        logits = model(ids[None, start:end], cache=caches)[0].astype(mx.float32)
        targets = ids[start + 1 : end + 1]
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        total = total - mx.take_along_axis(logp, targets[:, None], axis=-1).sum()
        mx.eval(total, [c.state for c in caches])
        if after_chunk is not None:
            after_chunk(caches)
        if end in contexts:
            seen[end] = sum(int(c.nbytes) for c in caches)
        mx.clear_cache()
    nll = float(total.item())  # type: ignore[arg-type]
    return PerplexityResult(math.exp(nll / n), n, seen)
