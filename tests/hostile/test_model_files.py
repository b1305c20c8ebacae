"""Model files from anywhere and packaging interrupted (defects 9, 10, 11 of issue 24): a config that claims ten
million layers or 1e15 positions, kvcache.json bits MLX has not, a tokenizer.json nested 200,000 deep, a disk that
fills during the GGUF conversion, and `kvrig package` stopped by SIGTERM or SIGKILL. Each ends with its documented
exit code, in seconds and a bounded amount of memory, and leaves no hidden folder behind for good."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvrig.models import default_model_path, read_config
from tests.bundle_fixtures import converted_source, smollm2_q4_k8v8
from tests.hostile.conftest import ROOT, kvrig
from tests.hostile_suite import hostile

DEEP = b'{"a":' * 200_000 + b"1" + b"}" * 200_000


def _measured(*args: str, limit_file_bytes: int | None = None) -> tuple[int, str, float, int]:
    """`kvrig ARGS` in a process of its own: exit code, stderr, seconds and its peak memory in MB."""
    code = (
        "import json, resource, signal, subprocess, sys, time\n"
        "limit = json.loads(sys.argv[1])\n"
        "def apply():\n"
        "    if limit:\n"
        "        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))\n"
        "t = time.monotonic()\n"
        "done = subprocess.run([sys.executable, '-m', 'kvrig', *sys.argv[2:]], capture_output=True, text=True,\n"
        "                      preexec_fn=apply)\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024\n"
        "print(json.dumps([done.returncode, done.stderr, time.monotonic() - t, peak]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(limit_file_bytes), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    exit_code, stderr, seconds, peak_mb = json.loads(done.stdout)
    return exit_code, stderr, seconds, peak_mb


CLAIMS: dict[str, dict[str, Any]] = {
    "num_hidden_layers 10000000": {"num_hidden_layers": 10_000_000},
    "num_hidden_layers 1e9": {"num_hidden_layers": 1_000_000_000},
    "max_position_embeddings 1e15": {"max_position_embeddings": 1e15},
    "max_position_embeddings 10**15": {"max_position_embeddings": 10**15},
    "vocab_size 2**40 in text_config": {"text_config": {"vocab_size": 2**40}},
}


@pytest.mark.parametrize("claim", list(CLAIMS))
@hostile(9, "a config.json that claims", "kvrig plan: exit 3 naming the field, in 20 s and 400 MB")
def test_a_config_claiming_a_giant_is_refused_before_it_is_built(claim: str, tmp_path: Path) -> None:
    config, _ = read_config(default_model_path())
    (tmp_path / "config.json").write_text(json.dumps({**config, **CLAIMS[claim]}))
    code, stderr, seconds, peak_mb = _measured("plan", str(tmp_path), "--device", "iphone-15-pro")
    assert code == 3, stderr
    field = next(iter(CLAIMS[claim]))
    assert f"field '{field}" in stderr and "expected a whole number from 1 to" in stderr
    assert "Traceback" not in stderr
    assert seconds < 20 and peak_mb < 400


HEADERS: dict[str, Any] = {
    "an entry that is a number": {"w": 1},
    "a list": [1, 2],
    "offsets backwards": {"w": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}},
    "no shape": {"w": {"dtype": "F16", "data_offsets": [0, 4]}},
}


@pytest.mark.parametrize("header", list(HEADERS))
@hostile(9, "a model's safetensors header that is", "kvrig plan: exit 3 naming the file, no traceback")
def test_a_safetensors_header_safetensors_would_not_write_is_refused(header: str, tmp_path: Path) -> None:
    """The planner reads a folder's safetensors headers for its tensor names (they decide a tied embedding)."""
    config, _ = read_config(default_model_path())
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = json.dumps(HEADERS[header]).encode()
    (tmp_path / "model.safetensors").write_bytes(len(data).to_bytes(8, "little") + data + b"\0" * 4)
    done = kvrig("plan", str(tmp_path), "--device", "iphone-15-pro")
    assert done.code == 3, done.stderr
    assert str(tmp_path / "model.safetensors") in done.stderr and "Traceback" not in done.stderr


def _bundle_copy(factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """The shared SmolLM2 q4 bundle, its big files hard-linked (never written through), small ones copied."""
    shared = smollm2_q4_k8v8(factory)
    copy = tmp_path / "bundle"
    shutil.copytree(shared, copy, copy_function=os.link)
    for small in copy.glob("*.json"):
        data = small.read_bytes()
        small.unlink()
        small.write_bytes(data)
    return copy


def _set_kv_bits(bundle: Path, bits: int, *, manifest_too: bool) -> None:
    kv = json.loads((bundle / "kvcache.json").read_text())
    kv["key_bits"] = bits
    data = json.dumps(kv, indent=2).encode()
    (bundle / "kvcache.json").write_bytes(data)
    if manifest_too:  # tampered and re-signed: the manifest agrees, only the schema can say no
        manifest = json.loads((bundle / "manifest.json").read_text())
        for entry in manifest["files"]:
            if entry["path"] == "kvcache.json":
                entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2))


@pytest.mark.parametrize("bits", [-4, 99])
@hostile(10, "kvcache.json key bits", "kvrig run, verify and app: exit 3 naming key_bits")
def test_kv_bits_mlx_does_not_have_are_refused_where_read(
    bits: int, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    bundle = _bundle_copy(tmp_path_factory, tmp_path)
    _set_kv_bits(bundle, bits, manifest_too=True)
    for args in (
        ["run", str(bundle), "--prompt", "hi", "--max-tokens", "1"],
        ["verify", str(bundle)],
        ["app", str(bundle), "--name", "X", "--bundle-id", "com.example.x", "-o", str(tmp_path / "app")],
    ):
        ran = kvrig(*args)
        assert ran.code == 3, (args[0], ran.stderr)
        assert "kvcache.json" in ran.stderr and "key_bits" in ran.stderr and "Traceback" not in ran.stderr
    assert not (tmp_path / "app").exists()


@hostile(10, "a bundle's tokenizer.json nested 200,000 deep", "kvrig run: exit 3 naming the file, in 30 s")
def test_a_deeply_nested_tokenizer_stops_kvrig_run(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    bundle = _bundle_copy(tmp_path_factory, tmp_path)
    (bundle / "tokenizer.json").write_bytes(DEEP)
    ran = kvrig("run", str(bundle), "--prompt", "hi", "--max-tokens", "1")
    assert ran.code == 3, ran.stderr
    assert "tokenizer.json: nested more than 256 levels deep" in ran.stderr and "Traceback" not in ran.stderr
    assert ran.seconds < 30


@hostile(10, "a model folder whose tokenizer.json is nested 200,000 deep", "kvrig package: exit 3, nothing written")
def test_a_deeply_nested_tokenizer_stops_kvrig_package(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    source = tmp_path / "model"
    shutil.copytree(converted_source(tmp_path_factory), source, copy_function=os.link)
    (source / "tokenizer.json").unlink()
    (source / "tokenizer.json").write_bytes(DEEP)
    ran = kvrig("package", str(source), "-o", str(tmp_path / "out" / "b"), "--no-quality-gate")
    assert ran.code == 3, ran.stderr
    assert "tokenizer.json: nested more than 256 levels deep" in ran.stderr and "Traceback" not in ran.stderr
    assert list((tmp_path / "out").iterdir()) == []


BROKEN_TOKENIZERS = {
    "cut short": lambda text: text[: len(text) // 2],
    "not a tokenizer": lambda _: json.dumps({"version": "1.0", "added_tokens": [], "model": 3}),
}


@pytest.mark.parametrize("broken", list(BROKEN_TOKENIZERS))
@hostile(10, "a tokenizer.json the tokenizers library cannot load", "kvrig package and run: exit 3 naming it")
def test_a_tokenizer_that_does_not_load_is_refused_naming_it(
    broken: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The tokenizers library raises a bare Exception (exit 70 before); package refuses before quantizing, and
    leaves nothing; run refuses a bundle whose manifest agrees with the broken file."""
    source = tmp_path / "model"
    shutil.copytree(converted_source(tmp_path_factory), source, copy_function=os.link)
    text = (source / "tokenizer.json").read_text()
    (source / "tokenizer.json").unlink()
    (source / "tokenizer.json").write_text(BROKEN_TOKENIZERS[broken](text))
    ran = kvrig("package", str(source), "-o", str(tmp_path / "out" / "b"), "--weights", "q8", "--kv", "fp16")
    assert ran.code == 3, ran.stderr
    assert f"{source / 'tokenizer.json'}: mlx-lm cannot load the tokenizer" in ran.stderr
    assert "Traceback" not in ran.stderr and ran.seconds < 60
    assert list((tmp_path / "out").iterdir()) == []

    bundle = _bundle_copy(tmp_path_factory, tmp_path)
    data = (source / "tokenizer.json").read_bytes()
    (bundle / "tokenizer.json").unlink()
    (bundle / "tokenizer.json").write_bytes(data)
    manifest = json.loads((bundle / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == "tokenizer.json":
            entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2))
    ran = kvrig("run", str(bundle), "--prompt", "hi", "--max-tokens", "1")
    assert ran.code == 3, ran.stderr
    assert f"{bundle / 'tokenizer.json'}: mlx-lm cannot load the tokenizer" in ran.stderr
    assert "Traceback" not in ran.stderr


def test_a_broken_tokenizer_config_is_named_not_tokenizer_json(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A line added to tokenizer_config.json was reported as tokenizer.json's fault (the JSON error says only
    where, not in which file); a bundle's message points at `kvrig verify`."""
    bundle = _bundle_copy(tmp_path_factory, tmp_path)
    config = bundle / "tokenizer_config.json"
    text = config.read_text()
    config.unlink()
    config.write_text(text + '{"extra": 1}\n')
    ran = kvrig("run", str(bundle), "--prompt", "hi", "--max-tokens", "1")
    assert ran.code == 3, ran.stderr
    assert f"{config}: mlx-lm cannot load the tokenizer (JSONDecodeError: Extra data" in ran.stderr
    assert "kvrig verify" in ran.stderr and "Traceback" not in ran.stderr


@pytest.mark.parametrize(
    ("field", "value", "code", "words"),
    [
        ("weights", "q9x", 3, "field 'recipe.weights'"),
        ("kv", "k8v4+rotz", 3, "field 'recipe.kv'"),
        ("kv", "k4v4+rot", 8, "kvcache.json: holds k8v8, where the manifest's recipe.kv says k4v4+rot"),
    ],
    ids=["weights misspelt", "kv misspelt", "kv not kvcache.json's"],
)
@hostile(10, "a manifest whose recipe", "kvrig verify: exit 3 naming the field, or 8 naming kvcache.json")
def test_a_manifest_recipe_outside_the_grammar_or_beside_another_kvcache_is_refused(
    field: str, value: str, code: int, words: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The manifest records the recipe and KV spec in the grammar `--weights` and `--kv` take, and kvcache.json is
    what the app runs: verify holds both (the manifest is not in its own file list, so only this can)."""
    bundle = _bundle_copy(tmp_path_factory, tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["recipe"][field] = value
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2))
    ran = kvrig("verify", str(bundle))
    assert ran.code == code, ran.stderr
    assert words in ran.stderr and "Traceback" not in ran.stderr


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@hostile(10, "the disk fills during the GGUF conversion of kvrig package", "exit 37; no .kvrig-convert-* left")
def test_a_full_disk_during_conversion_is_a_bundle_write_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    code, stderr, _, _ = _measured(
        "package", "-o", str(out / "b"), "--no-quality-gate", limit_file_bytes=32 * 1024 * 1024
    )
    assert code == 37, stderr
    assert "cannot write the converted model" in stderr and "Traceback" not in stderr
    assert list(out.iterdir()) == []


def _package(out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvrig", "package", "-o", str(out), "--weights", "q4", "--no-quality-gate"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(folder: Path, prefix: str, proc: subprocess.Popen[str], seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not any(p.name.startswith(prefix) and p.is_dir() for p in folder.iterdir()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {prefix}* appeared"
        time.sleep(0.05)


@hostile(11, "kvrig package SIGTERMed while it quantizes", "exit 143 within 30 s; no hidden folder left")
def test_sigterm_cleans_up_what_package_started(tmp_path: Path) -> None:
    proc = _package(tmp_path / "b")
    _wait_for(tmp_path, ".b.partial-", proc)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert time.monotonic() - start < 30
    assert "Traceback" not in stderr
    assert os.listdir(tmp_path) == []


@hostile(11, "kvrig package SIGKILLed while it quantizes", "its .b.partial-* and .kvrig-convert-* gone at the next run")
def test_the_next_package_removes_what_a_killed_one_left(tmp_path: Path) -> None:
    proc = _package(tmp_path / "b")
    _wait_for(tmp_path, ".b.partial-", proc)
    proc.kill()
    proc.communicate()
    left = _hidden(tmp_path)
    assert any(n.startswith(".kvrig-convert-") for n in left) and any(n.startswith(".b.partial-") for n in left)
    # any next package beside it; the command line refuses bad options before it, so this one fails later
    again = kvrig("package", str(tmp_path / "no-such-model"), "-o", str(tmp_path / "b"))
    assert again.code == 3 and "model not found" in again.stderr and "Traceback" not in again.stderr
    assert _hidden(tmp_path) == []


@hostile(11, "the hidden folders of a kvrig package still running", "left alone by a sweep: their lock is held")
def test_a_running_package_keeps_its_folders(tmp_path: Path) -> None:
    from kvrig.fileio import sweep_scratch
    from kvrig.models.source import CONVERT_PREFIX

    proc = _package(tmp_path / "b")
    try:
        _wait_for(tmp_path, ".b.partial-", proc)
        assert sweep_scratch(tmp_path, ".b.partial-") == [] and sweep_scratch(tmp_path, CONVERT_PREFIX) == []
        assert proc.poll() is None  # still writing: what the sweep left alone was in use
        assert any(n.startswith(".b.partial-") for n in _hidden(tmp_path))
    finally:
        proc.kill()
        proc.communicate()
