"""The generated app's engine, compiled against the real MLX Swift on Linux and run headless (kvrig-engine).

KV bytes: the engine's telemetry against three independent counts of the same cache updates: MLX's own
nbytes of mlx-lm's caches (and kvrig's dequantizing cache, as the Python host runtime builds them), and the
planner's replay. Tokens: greedy generation against plain mlx-lm on the same bundle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvrig.bundle.options import PackageOptions
from kvrig.schemas.kvcache import KVCacheConfig
from kvrig.schemas.soakplan import GrowthSchedule, SoakPlan
from tests.appgen.swift_engine import engine_binary, read_events, run_engine  # noqa: F401
from tests.bundle_fixtures import packaged

# Slow here: the engine's debug build runs MLX's C++ core unoptimised (a run of a few hundred tokens takes
# minutes on 2 shared cores). The default run covers the same: test_engine_virtual.py's
# test_swift_engine_soaks_into_jetsam checks the engine's kv_bytes against the planner at every unaligned
# step into jetsam; the build itself is checked by test_engine_modes.py.
pytestmark = pytest.mark.slow

PREFILL_STEP = 128
SCHEMES = ("fp16", "k8v8", "k8v4", "k4v4")
# Target 256 in two 128-token chunks fills the first 256-token step exactly; the decoded token then overflows
# it at an offset that is a multiple of 256 (mlx-lm keeps the whole buffer and appends a step).
ALIGNED = GrowthSchedule(start_tokens=256, step_tokens=256, max_tokens=256, decode_tokens=1)
# Targets 200, 300 (+1 decoded each): the second prefill overflows at offset 201 (the ragged tail is trimmed
# first); then two chat turns.
UNALIGNED = GrowthSchedule(start_tokens=200, step_tokens=100, max_tokens=300, decode_tokens=1)
CHAT = ("Name three colours.", "And two more?")
SOAK_TEXT = "The quick brown fox jumps over the lazy dog, again and again, while the context grows. "


def _bundle(factory: pytest.TempPathFactory, scheme: str) -> Path:
    options = PackageOptions(weights="q4", group_size=64, kv=scheme, prefill_step_size=PREFILL_STEP)
    return packaged(factory, f"smollm2-q4-{scheme}-p{PREFILL_STEP}", options)


def _chunks(n: int) -> list[int]:
    """The engine's cache updates for n prompt tokens, as mlx-lm's generate_step makes them: all but the last
    token in prefill steps, then the last one alone."""
    return [min(PREFILL_STEP, n - 1 - i) for i in range(0, n - 1, PREFILL_STEP)] + [1]


def _expected_from_mlx(bundle: Path, updates: list[int]) -> int:
    """Feeds the update sizes to the caches kvrig's Python host runtime builds for this kvcache.json (mlx-lm's
    KVCache / QuantizedKVCache, kvrig's DequantizingKVCache) in the phone's float16; MLX's nbytes of their
    buffers."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvrig.kvcache.caches import maybe_quantize, quantized_cache
    from kvrig.virtual.llm_memory import kv_bytes

    kv = KVCacheConfig.model_validate_json((bundle / "kvcache.json").read_text())
    config = json.loads((bundle / "config.json").read_text())
    heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    caches: list[Any] = [
        quantized_cache(e.key_bits, e.value_bits, kv.group_size, config["model_type"])
        if kv.quantized_kv_start == 0 and (e.key_bits or e.value_bits)
        else KVCache()
        for e in kv.layers
    ]
    for n in updates:
        x = mx.zeros((1, heads, n, head_dim), dtype=mx.float16)
        for cache in caches:
            cache.update_and_fetch(x, x)
        mx.eval([c.state for c in caches])
        maybe_quantize(caches, kv, config["model_type"])
    return kv_bytes(caches, "float16")[1]


def _expected_from_planner(bundle: Path, scheme: str, updates: list[int]) -> int:
    from kvrig.models import load_model_spec
    from kvrig.planner import kv_bytes
    from kvrig.recipes import parse_kv

    return kv_bytes(load_model_spec(bundle), parse_kv(scheme), updates)


def _run(engine: Path, bundle: Path, schedule: GrowthSchedule, scheme: str, tmp: Path, chat: bool) -> dict:
    documents = tmp / "Documents"
    documents.mkdir(parents=True)
    plan = SoakPlan(run_id=f"kv-{scheme}", scheme=scheme, schedule=schedule, text=SOAK_TEXT)
    (documents / "plan.json").write_text(plan.model_dump_json(by_alias=True))
    args = ["--kvrig-soak-plan", "plan.json", "--temperature", "0"]
    if chat:
        args += [a for prompt in CHAT for a in ("--chat", prompt)] + ["--max-tokens", "3", "--print-tokens"]
    out = run_engine(engine, bundle, documents, *args)
    turns = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {"events": read_events(documents / "telemetry.jsonl"), "turns": turns, "plan": plan}


def _updates_at_steps(run: dict) -> list[tuple[dict, list[int]]]:
    """Each step record with the cache updates the engine made up to it: the soak's prefill chunks and
    decoded tokens, then each chat turn's prompt chunks and generated tokens."""
    steps = [e for e in run["events"] if e["event"] == "step"]
    targets = list(range(run["plan"].schedule.start_tokens, run["plan"].schedule.max_tokens + 1,
                         run["plan"].schedule.step_tokens))  # fmt: skip
    updates: list[int] = []
    context = 0
    out = []
    for step, target in zip(steps, targets, strict=False):
        updates += _chunks(target - context) + [1] * (step["context_tokens"] - target)
        context = step["context_tokens"]
        out.append((step, list(updates)))
    for step, turn in zip(steps[len(targets) :], run["turns"], strict=True):
        generated = len(turn["tokens"])
        updates += _chunks(step["context_tokens"] - context - generated) + [1] * generated
        context = step["context_tokens"]
        out.append((step, list(updates)))
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("schedule", [ALIGNED, UNALIGNED], ids=["aligned", "unaligned"])
def test_kv_bytes_agree_with_mlx_and_the_planner(
    engine_binary: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    scheme: str,
    schedule: GrowthSchedule,
) -> None:
    bundle = _bundle(tmp_path_factory, scheme)
    run = _run(engine_binary, bundle, schedule, scheme, tmp_path, chat=schedule is UNALIGNED)
    events = run["events"]
    assert events[0]["event"] == "start" and events[0]["scheme"] == scheme
    assert "kv_bytes" in events[0]["converted"]  # the host's float32 buffers, counted as the phone's float16
    (end,) = [e for e in events if e["event"] == "end"]  # the soak's; chat turns follow it
    assert end["reason"] == "completed", end
    checked = _updates_at_steps(run)
    assert len(checked) == (2 + len(CHAT) if schedule is UNALIGNED else 1)
    for step, updates in checked:
        mlx = _expected_from_mlx(bundle, updates)
        assert step["kv_bytes"] == mlx, (step["context_tokens"], updates)
        assert _expected_from_planner(bundle, scheme, updates) == mlx, (step["context_tokens"], updates)


def test_greedy_tokens_equal_plain_mlx_lm(
    engine_binary: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
) -> None:
    """Both compute in float32 from the same q4 bundle with the same weights: the engine's host conversion
    (dequantized with float32 scales) and mlx-lm's model set to float32, then mlx-lm's `dequantize_model`.
    The first tokens must be the same ones, exactly."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import dequantize_model

    bundle = _bundle(tmp_path_factory, "fp16")
    count, prompt = 8, "Write one sentence about the sea."
    out = run_engine(engine_binary, bundle, tmp_path / "Documents", "--chat", prompt, "--temperature", "0",
                     "--max-tokens", str(count), "--print-tokens")  # fmt: skip
    (turn,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    model, tokenizer = load(str(bundle))[:2]
    model.set_dtype(mx.float32)
    model = dequantize_model(model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    expected: list[int] = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=count, sampler=lambda x: mx.argmax(x, axis=-1)):
        if int(token) in tokenizer.eos_token_ids:
            break
        expected.append(int(token))
    assert len(expected) >= 4
    assert turn["tokens"] == expected
