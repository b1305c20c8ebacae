"""Generation on the host with a bundle's KV configuration: chunked prefill, streaming decode, statistics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrig.exceptions import BundleError, ModelConfigError, SchemaError
from kvrig.fileio import check_json_files
from kvrig.kvcache.caches import make_caches, maybe_quantize
from kvrig.models import read_config
from kvrig.runtime.host import load_bundle_model
from kvrig.schemas import load_model_file
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_memory_bytes: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # The first generated token comes out of the prefill; decode speed counts the steps after it.
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if self.decode_seconds and steps > 0 else 0.0


UNCAPPED_CACHE_LIMIT = 1 << 50
"""An app that never caps MLX's buffer cache: Metal's default cap is MLX's memory limit, and on a host it must
not bind before the phone's would."""


@contextlib.contextmanager
def uncapped_cache() -> Iterator[None]:
    """MLX's buffer cache as an app kvrig did not write keeps it: uncapped, and never emptied by the generation
    loop (mlx-swift-lm 3.31's never calls Memory.clearCache; mlx-lm's Python loop empties it after every prefill
    chunk and every 256 tokens, so inside this block its clear_cache does nothing)."""
    import mlx.core as mx

    previous, clear = mx.set_cache_limit(UNCAPPED_CACHE_LIMIT), mx.clear_cache
    mx.clear_cache = lambda: None
    try:
        yield
    finally:
        mx.clear_cache = clear
        mx.set_cache_limit(previous)


def generate_tokens(
    model: Any,
    prompt: list[int],
    caches: list[Any],
    kv: KVCacheConfig,
    *,
    max_tokens: int,
    stop_tokens: set[int] | frozenset[int] = frozenset(),
    temperature: float = 0.0,
    stats: GenerationStats | None = None,
    model_type: str = "",
    on_step: Callable[[], None] | None = None,
) -> Iterator[int]:
    """Yields generated token ids (greedy unless `temperature` > 0) from mlx-lm's own `generate_step` with
    the bundle's caches and prefill step, filling `stats` as it goes. After every prefill chunk and every
    decoded token it converts caches that passed `quantized_kv_start` (kvrig's conversion: it also makes
    mixed-bit caches, which mlx-lm's `kv_bits` cannot) and calls `on_step`, kvrig's memory hook (the
    virtual app reports its memory there; an exception raised there ends the generation).

    generate_step feeds every token it yields back into the caches (it computes one step ahead), so after
    `n` tokens the caches hold the prompt and all `n`."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    if not prompt:
        raise ValueError("empty prompt")
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)

    def after_step() -> None:
        maybe_quantize(caches, kv, model_type)
        stats.peak_memory_bytes = max(stats.peak_memory_bytes, int(mx.get_peak_memory()))  # before a hook resets it
        if on_step is not None:
            on_step()

    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        # Called at 0, after each prefill chunk, and once the first token is out (done == total).
        if done == 0:
            return
        if done == total:
            stats.prefill_seconds = time.perf_counter() - t0
        after_step()

    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=make_sampler(temp=temperature),
        prompt_cache=caches,
        prefill_step_size=kv.prefill_step_size,
        prompt_progress_callback=progress,
    )
    t1 = 0.0
    for n, (token, _) in enumerate(steps):
        token_id = int(token)
        if n == 0:
            t1 = time.perf_counter()
        else:
            after_step()
        stats.tokens.append(token_id)
        stats.generated_tokens = n + 1
        stats.decode_seconds = time.perf_counter() - t1
        yield token_id
        if token_id in stop_tokens:
            stats.finish_reason = "stop"
            break
    stats.peak_memory_bytes = max(stats.peak_memory_bytes, int(mx.get_peak_memory()))


@dataclass
class LoadedBundle:
    path: Path
    model: Any
    tokenizer: Any
    config: dict[str, Any]
    kvcache: KVCacheConfig


def load_bundle(path: str | Path) -> LoadedBundle:
    path = Path(path)
    kv = load_model_file(KVCacheConfig, path / KVCACHE_NAME)
    check_json_files(path, error=ModelConfigError)  # mlx-lm's loaders recurse into whatever nesting they get
    config, config_file = read_config(path)
    if not isinstance(config.get("model_type"), str):
        raise ModelConfigError("missing", file=config_file, field="model_type", expected="the model's type")
    try:
        model, tokenizer, config = load_bundle_model(path)
    except (ValueError, KeyError, AttributeError, TypeError, OSError, RuntimeError) as exc:
        # what mlx-lm's loader raises on a damaged file (a weight file cut short, a config missing a field)
        raise BundleError(
            f"{path}: mlx-lm cannot load it ({type(exc).__name__}: {exc}); `kvrig verify {path}` checks every file"
        ) from None
    from mlx_lm.models.cache import make_prompt_cache

    listed, made = len([e for e in kv.layers if e.kind != "shared"]), len(make_prompt_cache(model))
    if listed != made:  # a kvcache.json from another model, or edited
        raise SchemaError(
            f"lists {listed} cache-holding layers, but the bundle's model makes {made} caches",
            file=path / KVCACHE_NAME,
            field="layers",
            expected="the kvcache.json kvrig package wrote with this model",
        )
    return LoadedBundle(path, model, tokenizer, config, kv)


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(ids)
    return list(tokenizer.encode(prompt))


def run_bundle(
    bundle: LoadedBundle,
    prompt: str,
    *,
    max_tokens: int = 128,
    chat: bool = True,
    temperature: float = 0.0,
    on_text: Callable[[str], None] | None = None,
) -> GenerationStats:
    """Generates from `prompt` with the bundle's KV configuration, streaming decoded text to `on_text`."""
    import mlx.core as mx

    kv = bundle.kvcache
    mx.set_cache_limit(kv.buffer_cache_limit_bytes)
    tok = bundle.tokenizer
    prompt_ids = encode_prompt(tok, prompt, chat=chat)
    model_type = str(bundle.config.get("model_type", ""))
    caches = make_caches(bundle.model, kv, model_type)
    stats = GenerationStats()
    detok = tok.detokenizer
    detok.reset()
    mx.reset_peak_memory()
    stop = set(getattr(tok, "eos_token_ids", None) or [])
    for token in generate_tokens(
        bundle.model,
        prompt_ids,
        caches,
        kv,
        max_tokens=max_tokens,
        stop_tokens=stop,
        temperature=temperature,
        stats=stats,
        model_type=model_type,
    ):
        if token in stop:
            break
        detok.add_token(token)
        # last_segment hands out the new text once; read it exactly once per token.
        if on_text is not None and (segment := detok.last_segment):
            on_text(segment)
    detok.finalize()
    if on_text is not None and (segment := detok.last_segment):
        on_text(segment)
    stats.text = detok.text
    return stats
