"""One generation loop (kvrig.runtime.generate on mlx-lm's generate_step) with kvrig's memory hook, on a
tiny mlx-lm llama built from its own arguments. Expected tokens come from mlx-lm's generate_step called
directly; expected cache offsets from the prefill chunking generate_step documents."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from kvrig.runtime.generate import GenerationStats, generate_tokens
from kvrig.schemas.kvcache import KVCacheConfig, LayerCache, host_kvcache
from tests.plan.tiny_configs import TINY_CONFIGS

LAYERS = TINY_CONFIGS["llama"]["num_hidden_layers"]


@pytest.fixture(scope="module")
def model() -> llama.Model:
    mx.random.seed(3)
    m = llama.Model(llama.ModelArgs.from_dict(TINY_CONFIGS["llama"]))
    mx.eval(m.parameters())
    return m


def _kv(prefill_step: int) -> KVCacheConfig:
    layers = [LayerCache(layer=i, kind="full") for i in range(LAYERS)]
    return host_kvcache(layers, max_context=4096, prefill_step_size=prefill_step)


@pytest.mark.parametrize("prefill_step", [4, 7, 64])
def test_the_hook_runs_after_every_chunk_and_token(model: llama.Model, prefill_step: int) -> None:
    prompt = [(7 * i + 3) % 97 for i in range(23)]  # ids below the tiny vocabulary
    caches = make_prompt_cache(model)
    offsets: list[int] = []
    stats = GenerationStats()
    tokens = list(
        generate_tokens(
            model,
            prompt,
            caches,
            _kv(prefill_step),
            max_tokens=5,
            stats=stats,
            on_step=lambda: offsets.append(int(caches[0].offset)),
        )
    )
    # The same tokens as mlx-lm's own loop on fresh caches.
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=5, prefill_step_size=prefill_step)]
    assert tokens == expected and stats.generated_tokens == 5
    # Prefill: all but the last prompt token in chunks of prefill_step; the hook sees each chunk's cache.
    chunks = math.ceil((len(prompt) - 1) / prefill_step)
    assert offsets[:chunks] == [min((k + 1) * prefill_step, len(prompt) - 1) for k in range(chunks)]
    # Then once per generated token; generate_step runs one step ahead, so the caches already hold it.
    assert offsets[chunks:] == [len(prompt) + n for n in range(1, 6)]
    assert caches[0].offset == len(prompt) + 5


def test_an_exception_in_the_hook_ends_generation(model: llama.Model) -> None:
    class Killed(Exception):
        pass

    calls = 0

    def hook() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise Killed

    with pytest.raises(Killed):
        list(generate_tokens(model, list(range(20)), make_prompt_cache(model), _kv(8), max_tokens=4, on_step=hook))
    assert calls == 2
