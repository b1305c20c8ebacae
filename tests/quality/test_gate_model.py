"""Quality on the real SmolLM2-135M, beside test_quality_model.py: 8-bit KV keeps the greedy tokens, and `kvrig
package`'s quality gate refuses a deliberately broken bundle (2-bit weights) with exit code 45, leaves nothing
behind, and records a forced failure in manifest.json."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from kvrig.bundle.options import PackageOptions
from kvrig.exceptions import QualityGateError
from kvrig.kvcache.kv_cache import SchemeKVCache
from kvrig.models import load_model_spec
from kvrig.packaging import package
from kvrig.quality.schemes import make_kv_caches
from kvrig.quantize.base import load_source_model
from kvrig.recipes import parse_kv
from tests.bundle_fixtures import converted_source

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted_source(tmp_path_factory)


def test_k8v8_greedy_tokens_equal_fp16(source: Path) -> None:
    """The first greedy tokens through mlx-lm's 8-bit cache and kvrig's rotated 8-bit scheme cache equal those
    through an unquantized cache (the reference: mlx-lm's own KVCache)."""
    from mlx_lm.utils import load_tokenizer

    # mlx-lm's own model at float32 (the host's float16 layers cast every weight at every decoded token: 4x slower)
    model = load_source_model(source)[0]
    model.set_dtype(mx.float32)
    spec = load_model_spec(source / "config.json")
    ids = mx.array(load_tokenizer(source).encode(PROMPT))[None]

    def greedy(caches: list[object], n: int = 8) -> list[int]:
        logits = model(ids, cache=caches)
        out = []
        for _ in range(n):
            out.append(int(mx.argmax(logits[0, -1]).item()))
            logits = model(mx.array([[out[-1]]]), cache=caches)
        return out

    ref = greedy(make_kv_caches(model, spec, parse_kv("fp16")))
    assert greedy(make_kv_caches(model, spec, parse_kv("k8v8"))) == ref
    rotated = make_kv_caches(model, spec, parse_kv("k8v8+rot"))
    assert all(type(c) is SchemeKVCache for c in rotated)
    assert greedy(rotated) == ref


def test_gate_refuses_a_broken_bundle(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "q2"
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "package", str(source), "--weights", "q2", "--kv", "k8v4", "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == QualityGateError.exit_code == 45, proc.stderr
    assert "quality gate" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".q2")]

    forced = package(source, out, PackageOptions(weights="q2", kv="k8v4", quality_gate=True, ignore_gate=True))
    q = forced.manifest.quality
    assert q is not None and not q.passed and q.forced and q.ppl_delta_pct > 10


def test_the_gate_reads_the_users_text_as_a_kind_of_its_own(source: Path, tmp_path: Path) -> None:
    """`--gate-text FILE`: the file is one more gate kind, named by its path, its source perplexity the one
    mlx-lm's own model gives on its passages (NLL summed by hand here)."""
    import email.message
    import inspect
    import json
    import math

    from mlx_lm.utils import load_model, load_tokenizer

    from kvrig.quality.gate import GATE_KINDS, GATE_SEGMENTS, SEGMENT_TOKENS
    from kvrig.texts import kind_segments

    mine = tmp_path / "mine.py"
    mine.write_text(inspect.getsource(email.message))  # no kind kvrig reads
    out = tmp_path / "bundle"
    args = ["package", str(source), "--weights", "q8", "--kv", "fp16", "--gate-text", str(mine), "--no-cache"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", *args, "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    quality = json.loads((out / "manifest.json").read_text())["quality"]
    assert [k["kind"] for k in quality["kinds"]] == [*GATE_KINDS, str(mine)]
    assert str(mine) in quality["text"]
    (check,) = [k for k in quality["kinds"] if k["kind"] == str(mine)]

    reference, _ = load_model(source)
    reference.set_dtype(mx.float32)
    nll = n = 0.0
    for ids in kind_segments(load_tokenizer(source), str(mine), GATE_SEGMENTS, SEGMENT_TOKENS):
        x = mx.array([ids])
        logits = reference(x[:, :-1]).astype(mx.float32)  # type: ignore[operator]
        picked = mx.take_along_axis(logits, x[:, 1:, None], axis=-1)[..., 0]
        nll += (mx.logsumexp(logits, axis=-1) - picked).sum().item()
        n += x.shape[1] - 1
    assert check["tokens"] == n
    assert check["source_ppl"] == pytest.approx(math.exp(nll / n), rel=2e-3)
    assert check["ppl_delta_pct"] == pytest.approx(100 * (check["bundle_ppl"] / check["source_ppl"] - 1), abs=1e-2)


def test_a_gate_text_too_short_for_its_passages_is_refused_before_quantizing(source: Path, tmp_path: Path) -> None:
    from kvrig.exceptions import QualityInputError

    short = tmp_path / "short.txt"
    short.write_text("A few words of my own.\n" * 40)
    out = tmp_path / "bundle"
    args = ["package", str(source), "--weights", "q8", "--kv", "fp16", "--gate-text", str(short), "-o", str(out)]
    proc = subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True)
    assert proc.returncode == QualityInputError.exit_code, proc.stderr
    assert str(short) in proc.stderr and "fewer than the 256 asked for" in proc.stderr
    assert "quantizing" not in proc.stderr and not out.exists()


def test_a_gate_text_that_is_no_text_is_refused_before_quantizing(tmp_path: Path) -> None:
    from kvrig.exceptions import QualityInputError

    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    out = tmp_path / "bundle"
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "package", "--weights", "q8", "--gate-text", str(binary), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == QualityInputError.exit_code, proc.stderr
    assert str(binary) in proc.stderr and "UTF-8" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and "quantiz" not in proc.stderr.lower()


def test_a_gate_text_without_the_gate_is_refused(tmp_path: Path) -> None:
    """The file would be read by nothing: refused naming the option (exit 3), not silently dropped."""
    from kvrig.exceptions import InputError

    mine = tmp_path / "mine.txt"
    mine.write_text("text\n")
    with pytest.raises(InputError) as refused:
        package(None, tmp_path / "b", PackageOptions(weights="q8", quality_gate=False, gate_texts=(str(mine),)))
    assert type(refused.value) is InputError and refused.value.field == "--gate-text"
    assert not (tmp_path / "b").exists()


def test_a_missing_gate_text_is_refused_naming_it(tmp_path: Path) -> None:
    """The library call (the CLI's click.Path refuses first): the input error naming the file, nothing written."""
    from kvrig.exceptions import QualityInputError

    missing = tmp_path / "gone.txt"
    with pytest.raises(QualityInputError) as refused:
        package(None, tmp_path / "b", PackageOptions(weights="q8", gate_texts=(str(missing),)))
    assert refused.value.file == str(missing) and "No such file" in str(refused.value)
    assert not (tmp_path / "b").exists()
