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
    if len(tokens) < 2:
        raise ValueError("perplexity needs at least two tokens")
    nll, n, seen = _nll(model, [tokens], caches, chunk, contexts, after_chunk)
    return PerplexityResult(math.exp(nll / n), n, seen)


def rows_nll(model: Any, rows: list[list[int]], caches: list[Any], *, chunk: int = 256) -> tuple[float, int]:
    """The summed NLL and the number of predicted tokens of equal-length `rows` read side by side (one batch)
    from empty caches: each row's numbers as `perplexity` gives them alone, to float rounding, in fewer and
    larger matrix products (a quantized weight is dequantized once per chunk, not once per row)."""
    if len({len(r) for r in rows}) != 1 or len(rows[0]) < 2:
        raise ValueError("rows_nll needs rows of one length, at least two tokens")
    nll, n, _ = _nll(model, rows, caches, chunk, (), None)
    return nll, n


def _nll(
    model: Any,
    rows: list[list[int]],
    caches: list[Any],
    chunk: int,
    contexts: tuple[int, ...],
    after_chunk: Callable[[list[Any]], None] | None,
) -> tuple[float, int, dict[int, int]]:
    import mlx.core as mx

    ids = mx.array(rows)
    total = mx.array(0.0, dtype=mx.float32)
    n = ids.shape[1] - 1
    seen: dict[int, int] = {}
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        logits = model(ids[:, start:end], cache=caches).astype(mx.float32)
        targets = ids[:, start + 1 : end + 1]
        # -log p(target) = logsumexp(logits) - logits[target]: the same float subtraction per token as taking the
        # target from (logits - logsumexp), without writing that vocabulary-wide array (SmolLM2: 49k per token).
        picked = mx.take_along_axis(logits, targets[..., None], axis=-1)
        total = total + (mx.logsumexp(logits, axis=-1, keepdims=True) - picked).sum()
        mx.eval(total, [c.state for c in caches])
        if after_chunk is not None:
            after_chunk(caches)
        if end in contexts:
            seen[end] = sum(int(c.nbytes) for c in caches)
        mx.clear_cache()
    return float(total.item()), n * len(rows), seen  # type: ignore[arg-type]
