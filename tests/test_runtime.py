"""The host runtime on real SmolLM2 bundles: `kvrig run` (OpenBLAS preloaded, streaming, statistics) gives
the same greedy tokens as plain mlx-lm on the same bundle; the GGUF conversion's perplexity; the tokenizer
rebuilt from GGUF metadata; a tiny qwen2 GGUF converts into something mlx-lm runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from kvrig.models.gguf_convert import convert_gguf
from tests.bundle_fixtures import converted_source, smollm2_q4_k8v8
from tests.gguf_writer import write_gguf

QUESTION = "What is the capital of France?"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def q4_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm2_q4_k8v8(tmp_path_factory)


def test_run_matches_plain_mlx_lm(q4_bundle: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "run", str(q4_bundle), "-p", QUESTION, "-n", "8", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    ours = json.loads(proc.stdout)
    assert ours["openblas"] is True  # the CLI re-executed itself with OpenBLAS preloaded
    assert ours["generated_tokens"] == 8 and ours["prefill_tps"] > 0 and ours["decode_tps"] > 0
    assert ours["peak_memory_bytes"] > 0

    # Plain mlx-lm on the same bundle with the same KV cache (8-bit, group 64, from the first token);
    # float32 only so the CPU does not emulate float16.
    model, tok = load(str(q4_bundle))[:2]
    model.set_dtype(mx.float32)
    prompt = mx.array(tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True))
    assert ours["prompt_tokens"] == prompt.size
    steps = generate_step(prompt, model, max_tokens=8, kv_bits=8, kv_group_size=64, quantized_kv_start=0)
    plain = [int(t) for t, _ in steps]
    assert ours["tokens"] == plain


def test_run_streams_text_and_prints_stats(q4_bundle: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "run", str(q4_bundle), "-p", QUESTION, "-n", "6"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "tok/s" in proc.stderr and "peak memory" in proc.stderr


def test_run_on_a_folder_that_is_not_a_bundle(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "run", str(tmp_path), "-p", "hi"], capture_output=True, text=True
    )
    assert proc.returncode == 7  # BundleError: a folder that is not a bundle, as verify and deploy say
    assert "manifest.json" in proc.stderr and "Traceback" not in proc.stderr


def _damage(bundle: Path, how: str) -> None:
    config = bundle / "config.json"
    if how == "config not JSON":
        config.write_text("{bad")
    elif how == "config a list":
        config.write_text("[1]")
    elif how == "quantization without bits":
        data = json.loads(config.read_text())
        for key in ("quantization", "quantization_config"):
            data.get(key, {}).pop("bits", None)
        config.write_text(json.dumps(data))
    elif how == "kvcache.json of another model":
        kv = json.loads((bundle / "kvcache.json").read_text())
        (bundle / "kvcache.json").write_text(json.dumps({**kv, "layers": kv["layers"][:3]}))
    elif how == "weights cut short":
        with next(bundle.glob("*.safetensors")).open("r+b") as fh:
            fh.truncate(1000)


@pytest.mark.parametrize(
    ("how", "code", "words"),
    [
        ("config not JSON", 3, "config.json: not valid JSON"),
        ("config a list", 3, "config.json: not a JSON mapping"),
        ("quantization without bits", 7, "mlx-lm cannot load it (KeyError"),
        ("weights cut short", 7, "mlx-lm cannot load it (RuntimeError"),
        ("kvcache.json of another model", 3, "field 'layers': lists 3 cache-holding layers"),
    ],
)
def test_run_on_a_damaged_bundle_names_it(q4_bundle: Path, tmp_path: Path, how: str, code: int, words: str) -> None:
    """What mlx-lm's loader raises on a damaged file is the bundle's error (exit 3 or 7), never 'a bug in kvrig'."""
    copy = tmp_path / "b"
    shutil.copytree(q4_bundle, copy)
    _damage(copy, how)
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "run", str(copy), "-p", "hi", "-n", "1"], capture_output=True, text=True
    )
    assert proc.returncode == code, proc.stderr
    assert words in proc.stderr and str(copy) in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("how", "code", "words"),
    [
        ("not a bundle", 7, "manifest.json"),
        ("config not JSON", 8, "config.json: size"),
        ("kv bits", 8, "kvcache.json: s"),
        ("weights cut short", 8, "safetensors: size"),
    ],
)
def test_bench_runtime_reads_the_bundle_before_its_sides_run(
    q4_bundle: Path, tmp_path: Path, how: str, code: int, words: str
) -> None:
    """Each side runs in a process of its own, whose failure was exit 1 whatever the cause: the bundle is held to
    its manifest first, as `kvrig verify` holds it, and a wrong one gets its own exit code naming the file."""
    copy = tmp_path / "b"
    shutil.copytree(q4_bundle, copy)
    if how == "not a bundle":
        (copy / "manifest.json").unlink()
    elif how == "kv bits":
        kv = json.loads((copy / "kvcache.json").read_text())
        (copy / "kvcache.json").write_text(json.dumps({**kv, "key_bits": 7}))
    else:
        _damage(copy, how)
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "bench", "runtime", str(copy), "--no-reference"], capture_output=True, text=True
    )
    assert proc.returncode == code, proc.stderr
    assert words in proc.stderr and str(copy) in proc.stderr and "benchmark side" not in proc.stderr


PERPLEXITY = """
import math, sys
import mlx.core as mx, mlx.nn as nn
from kvrig.runtime.host import load_bundle_model
model, tok, _ = load_bundle_model(sys.argv[1])
ids = mx.array(tok.encode(open(sys.argv[2]).read())[:256])[None]
print(math.exp(nn.losses.cross_entropy(model(ids[:, :-1]), ids[:, 1:]).mean().item()))
"""


def test_conversion_perplexity_on_english(tmp_path_factory: pytest.TempPathFactory) -> None:
    """About 18 on the GPL-3 text with the right rope layout, about 900 with the wrong one.
    Run in a child with OpenBLAS preloaded (float matmuls are several times faster)."""
    from kvrig.runtime.blas import preload_env

    source = converted_source(tmp_path_factory)
    proc = subprocess.run(
        [sys.executable, "-c", PERPLEXITY, str(source), str(REPO / "LICENSE")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=preload_env(enable=True),
    )
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip().splitlines()[-1]) < 40


def test_rebuilt_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tokenizers import Tokenizer

    from kvrig.models.gguf import embedded_default_model, read_gguf_header

    tok = Tokenizer.from_file(str(converted_source(tmp_path_factory) / "tokenizer.json"))
    tokens = read_gguf_header(embedded_default_model()).metadata["tokenizer.ggml.tokens"]
    text = "Hello world! 12345 café ünïcode\n  indented"
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    assert all(tokens[i] == t for i, t in zip(enc.ids, enc.tokens, strict=True))
    # SmolLM2 splits digits one by one (its pre-tokenizer) and keeps chat markers whole.
    assert [tokens[i] for i in tok.encode("12345").ids] == ["1", "2", "3", "4", "5"]
    assert tok.encode("<|im_start|>user").ids[0] == tokens.index("<|im_start|>")


def test_tiny_qwen2_gguf_converts_and_runs(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, ffn, vocab = 32, 4, 2, 64, 16
    head_dim = hidden // heads
    t = {"token_embd.weight": rng.normal(size=(vocab, hidden)), "output_norm.weight": np.ones(hidden)}
    for name, shape in {
        "attn_q.weight": (hidden, hidden),
        "attn_q.bias": (hidden,),
        "attn_k.weight": (kv_heads * head_dim, hidden),
        "attn_k.bias": (kv_heads * head_dim,),
        "attn_v.weight": (kv_heads * head_dim, hidden),
        "attn_v.bias": (kv_heads * head_dim,),
        "attn_output.weight": (hidden, hidden),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
    }.items():
        t[f"blk.0.{name}"] = rng.normal(size=shape) * 0.1
    md = {
        "general.architecture": "qwen2",
        "qwen2.embedding_length": hidden,
        "qwen2.block_count": 1,
        "qwen2.feed_forward_length": ffn,
        "qwen2.attention.head_count": heads,
        "qwen2.attention.head_count_kv": kv_heads,
        "qwen2.context_length": 128,
        "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "general.file_type": 0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": ["a", "b", "c", "d", "ab", "cd", *[f"<x{i}>" for i in range(9)], "<|end|>"],
        "tokenizer.ggml.merges": ["a b", "c d"],
        "tokenizer.ggml.token_type": [1] * 15 + [3],
        "tokenizer.ggml.eos_token_id": 15,
    }
    gguf = write_gguf(tmp_path / "tiny.gguf", md, t)
    convert_gguf(gguf, tmp_path / "hf")
    model, tok = load(str(tmp_path / "hf"))[:2]
    weights = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    assert isinstance(weights, dict)
    np.testing.assert_allclose(
        np.array(weights["model.layers.0.self_attn.q_proj.weight"]), t["blk.0.attn_q.weight"], rtol=1e-6
    )
    assert tok.encode("abcd") == [4, 5]
    out = model(mx.array([[4, 5]]))
    assert out.shape == (1, 2, vocab)


def test_caches_follow_kvcache_json(q4_bundle: Path) -> None:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from kvrig.kvcache.caches import make_caches
    from kvrig.kvcache.kv_cache import SchemeKVCache
    from kvrig.runtime.generate import GenerationStats, generate_tokens, load_bundle

    loaded = load_bundle(q4_bundle)
    kv = loaded.kvcache
    assert all(type(c) is QuantizedKVCache and c.bits == 8 for c in make_caches(loaded.model, kv, "llama"))
    mixed = kv.model_copy(
        update={"layers": [layer.model_copy(update={"value_bits": 4}) for layer in kv.layers], "scheme": "k8v4"}
    )
    caches = make_caches(loaded.model, mixed, "llama")
    assert all(type(c) is SchemeKVCache and (c.key_bits, c.value_bits) == (8, 4) for c in caches)

    # Quantization starts once the context passes quantized_kv_start (prefill chunks of 8 tokens here).
    late = mixed.model_copy(update={"quantized_kv_start": 16, "prefill_step_size": 8})
    caches = make_caches(loaded.model, late, "llama")
    assert all(type(c) is KVCache for c in caches)
    prompt = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)[:30]
    stats = GenerationStats()
    tokens = list(generate_tokens(loaded.model, prompt, caches, late, max_tokens=3, stats=stats, model_type="llama"))
    assert len(tokens) == 3 and stats.prompt_tokens == 30
    assert all(type(c) is SchemeKVCache for c in caches)
    # mlx-lm's generate_step computes one step ahead: every token it yielded is in the caches.
    assert caches[0].offset == 30 + 3
