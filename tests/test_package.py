"""`kvrig package` / `verify` on the real SmolLM2 GGUF: bundle contents, plain mlx-lm loading it, greedy
generation against the source, manifest checks, and the error paths. SmolLM2 is packaged once per session."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

import kvrig.packaging as bundle_mod
from kvrig.bundle.manifest import verify_bundle
from kvrig.bundle.options import PackageOptions, PlanView
from kvrig.exceptions import (
    BundleError,
    BundleExistsError,
    DoesNotFitError,
    ModelConfigError,
    QuantizationError,
    UnsupportedArchitectureError,
    VerifyError,
)
from kvrig.models.gguf import embedded_default_model
from kvrig.packaging import package
from kvrig.recipes import parse_kv
from kvrig.schemas import load_model_file
from kvrig.schemas.bundle import Manifest
from kvrig.schemas.kvcache import KVCacheConfig
from tests.bundle_fixtures import converted_source, smollm2_q4_k8v8, tiny_source
from tests.gguf_writer import write_gguf

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("package")


@pytest.fixture(scope="session")
def q4_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm2_q4_k8v8(tmp_path_factory)


@pytest.fixture(scope="session")
def q8_bundle(workdir: Path) -> Path:
    out = workdir / "smollm2-q8"
    package(embedded_default_model(), out, PackageOptions(weights="q8", group_size=32, kv="k8v4", quality_gate=False))
    return out


@pytest.fixture(scope="session")
def source_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted_source(tmp_path_factory)


def _plain_f32(path: Path):
    """Plain mlx-lm loading; float32 so the CPU does not emulate float16 (only speed changes)."""
    model, tok = load(str(path))[:2]
    model.set_dtype(mx.float32)
    return model, tok


def _greedy(model, tok, n: int) -> list[int]:
    ids = mx.array(tok.encode(PROMPT))
    return [int(t) for t, _ in generate_step(ids, model, max_tokens=n)]


def _last_logits(model, tok) -> mx.array:
    return model(mx.array(tok.encode(PROMPT))[None])[0, -1].astype(mx.float32)


def test_bundle_contents(q4_bundle: Path) -> None:
    config = json.loads((q4_bundle / "config.json").read_text())
    assert config["quantization"]["group_size"] == 64
    assert config["quantization"]["bits"] == 4
    assert config["quantization_config"]["group_size"] == 64
    assert (q4_bundle / "tokenizer.json").is_file()
    assert "chat_template" in json.loads((q4_bundle / "tokenizer_config.json").read_text())
    kv = load_model_file(KVCacheConfig, q4_bundle / "kvcache.json")
    assert (kv.key_bits, kv.value_bits, kv.group_size) == (8, 8, 64)
    assert len(kv.layers) == config["num_hidden_layers"]
    assert all(layer.kind == "full" and layer.key_bits == 8 for layer in kv.layers)
    manifest = load_model_file(Manifest, q4_bundle / "manifest.json")
    on_disk = sorted(p.name for p in q4_bundle.iterdir() if p.name != "manifest.json")
    assert sorted(f.path for f in manifest.files) == on_disk
    for entry in manifest.files:
        data = (q4_bundle / entry.path).read_bytes()
        assert entry.size == len(data)
        assert entry.sha256 == hashlib.sha256(data).hexdigest()
    assert manifest.source.kind == "gguf"
    assert manifest.source.sha256 == hashlib.sha256(embedded_default_model().read_bytes()).hexdigest()
    assert manifest.recipe.weights == "q4" and manifest.recipe.group_size == 64
    # No temporary folders left next to the bundle.
    assert not [p for p in q4_bundle.parent.iterdir() if p.name.startswith(".")]


def test_weights_are_quantized_as_mlx_counts(q4_bundle: Path) -> None:
    weights = mx.load(str(q4_bundle / "model.safetensors"))
    assert isinstance(weights, dict)
    w = weights["model.layers.0.mlp.gate_proj.weight"]
    assert w.dtype == mx.uint32 and w.shape == (1536, 576 * 4 // 32)
    assert weights["model.layers.0.mlp.gate_proj.scales"].shape == (1536, 576 // 64)


def test_q8_bundle_generates_like_the_source(q8_bundle: Path, source_dir: Path) -> None:
    """8-bit re-quantization of the GGUF's weights is close to lossless: same greedy tokens."""
    bundle_model, tok = _plain_f32(q8_bundle)
    source_model, _ = _plain_f32(source_dir)
    assert _greedy(bundle_model, tok, 8) == _greedy(source_model, tok, 8)
    kv = load_model_file(KVCacheConfig, q8_bundle / "kvcache.json")
    assert (kv.key_bits, kv.value_bits) == (8, 4)


def test_q4_bundle_logits_within_tolerance(q4_bundle: Path, source_dir: Path) -> None:
    """4-bit group-64 re-quantization of a Q4_1 (group 32) GGUF moves the logits; stated tolerance: cosine
    similarity of the next-token logits >= 0.95 and the source's greedy token in the bundle's top 5."""
    bundle_model, tok = _plain_f32(q4_bundle)
    source_model, _ = _plain_f32(source_dir)
    a, b = _last_logits(bundle_model, tok), _last_logits(source_model, tok)
    cos = (a * b).sum() / (mx.linalg.norm(a) * mx.linalg.norm(b))
    assert cos.item() >= 0.95
    top5 = mx.argsort(-a)[:5].tolist()
    assert int(mx.argmax(b).item()) in top5


def test_verify_ok_and_catches_truncated_and_edited_files(q4_bundle: Path, tmp_path: Path) -> None:
    assert verify_bundle(q4_bundle).checked == 6
    copy = tmp_path / "b"
    shutil.copytree(q4_bundle, copy)
    with (copy / "model.safetensors").open("r+b") as fh:
        fh.truncate(1000)
    kv = copy / "kvcache.json"
    kv.write_text(kv.read_text().replace('"keep_tokens": 4', '"keep_tokens": 5'))
    with pytest.raises(VerifyError) as info:
        verify_bundle(copy)
    text = str(info.value)
    assert "model.safetensors: size 1000 bytes" in text
    assert "kvcache.json: sha256 differs" in text
    proc = subprocess.run([sys.executable, "-m", "kvrig", "verify", str(copy)], capture_output=True, text=True)
    assert proc.returncode == 8
    assert "model.safetensors" in proc.stderr and "Traceback" not in proc.stderr


def test_verify_refuses_a_file_the_manifest_lists_twice(q4_bundle: Path, tmp_path: Path) -> None:
    copy = tmp_path / "b"
    shutil.copytree(q4_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"].append(manifest["files"][0])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(VerifyError) as info:
        verify_bundle(copy)
    assert f"{manifest['files'][0]['path']}: listed twice in the manifest" in str(info.value)
    with pytest.raises(BundleError, match="no such folder"):
        verify_bundle(tmp_path / "nowhere")


def test_existing_output_folder(q4_bundle: Path) -> None:
    with pytest.raises(BundleExistsError, match="already exists; use --replace to replace it"):
        package(None, q4_bundle, PackageOptions(weights="q8", quality_gate=False, kv="k8v8"))


def test_force_replaces_a_bundle_but_nothing_else(q4_bundle: Path, source_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    shutil.copytree(q4_bundle, out)
    result = package(source_dir, out, PackageOptions(weights="q8", quality_gate=False, kv="k8v4", replace=True))
    assert result.path == out
    # The new bundle is in place, whole; the old one and the temporary folder are gone.
    assert load_model_file(KVCacheConfig, out / "kvcache.json").scheme == "k8v4"
    assert verify_bundle(out).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]

    # A folder that is not a bundle is never replaced, even with --replace; an empty one is.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(BundleExistsError, match="not a kvrig bundle"):
        package(source_dir, mine, PackageOptions(weights="q8", quality_gate=False, kv="k8v4", replace=True))
    assert (mine / "notes.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        package(
            source_dir, empty, PackageOptions(weights="q8", quality_gate=False, kv="k8v4", replace=True)
        ).kvcache.scheme
        == "k8v4"
    )


def test_loading_tells_an_unknown_architecture_from_a_broken_config(tmp_path: Path) -> None:
    """mlx-lm raises ValueError for both; the unknown type is the one caused by a missing module (exit 4), the
    rest is the config's fault (exit 5's ModelConfigError), whatever mlx-lm's message says."""
    from kvrig.quantize.base import load_source_model

    for name, config, error in [
        ("unknown", {"model_type": "mamba9", "hidden_size": 8}, UnsupportedArchitectureError),
        ("broken", {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1}, ModelConfigError),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        mx.save_safetensors(str(folder / "model.safetensors"), {"w": mx.zeros((2,))})
        with pytest.raises(error) as caught:
            load_source_model(folder)
        assert str(folder / "config.json") in str(caught.value)


def test_missing_and_incomplete_model_dirs(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="not found"):
        package(tmp_path / "nope", tmp_path / "out", PackageOptions(weights="q8", quality_gate=False))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        package(tmp_path / "empty", tmp_path / "out", PackageOptions(weights="q8", quality_gate=False))
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "m.gguf", {"general.architecture": "mamba9", "mamba9.block_count": 1})
    with pytest.raises(UnsupportedArchitectureError, match="mamba9"):
        package(gguf, tmp_path / "out1", PackageOptions(weights="q8", quality_gate=False))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "mamba9", "hidden_size": 8}))
    mx.save_safetensors(str(hf / "model.safetensors"), {"w": mx.zeros((2,))})
    with pytest.raises(UnsupportedArchitectureError, match="mamba9"):
        package(hf, tmp_path / "out2", PackageOptions(weights="q8", quality_gate=False, kv="fp16"))
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()


def test_does_not_fit_refuses_and_force_packages(
    source_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The planner is faked here (its own tests compare it to MLX); this tests the refusal path. The device is a real
    # profile: package refuses an unknown one before it reads the model.
    plan = PlanView("iPhone-test", 100 * 2**20, 75 * 2**20, 10_000, 100, 90 * 2**20)
    monkeypatch.setattr(bundle_mod, "plan_for_bundle", lambda *a, **k: plan)
    with pytest.raises(DoesNotFitError, match=r"max context is 100 tokens, 156 short of 256"):
        package(
            source_dir,
            tmp_path / "out",
            PackageOptions(weights="q8", quality_gate=False, device="iPhone16,1", kv="k8v8"),
        )
    assert not (tmp_path / "out").exists()
    result = package(
        source_dir,
        tmp_path / "out",
        PackageOptions(weights="q8", quality_gate=False, device="iPhone16,1", kv="k8v8", ignore_fit=True),
    )
    assert result.manifest.prediction is not None
    assert result.manifest.prediction.forced and not result.manifest.prediction.fits
    assert result.kvcache.max_context == 100
    assert result.kvcache.memory_limit_bytes == 90 * 2**20
    assert result.warnings and "--ignore-fit" in result.warnings[0]


@pytest.fixture
def small_disk(tmp_path: Path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_leaves_nothing_half_written(source_dir: Path, small_disk: Path) -> None:
    with pytest.raises(BundleError, match="disk full"):
        package(source_dir, small_disk / "bundle", PackageOptions(weights="q8", quality_gate=False, kv="k8v8"))
    assert list(small_disk.iterdir()) == []


def test_real_plan_refuses_a_model_too_big_for_the_device(tmp_path: Path) -> None:
    """A 70B-sized llama config cannot fit an iPhone: refused before any weight is read, with the overshoot."""
    hf = tmp_path / "big"
    hf.mkdir()
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    (hf / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(hf / "model.safetensors"), {"placeholder": mx.zeros((1,))})
    with pytest.raises(DoesNotFitError, match=r"weights alone \(.*MiB\) exceed the .* limit by .*MiB"):
        package(hf, tmp_path / "out", PackageOptions(weights="q8", quality_gate=False, device="iPhone15,2"))
    assert not (tmp_path / "out").exists()


def test_package_with_a_device_records_the_plan(source_dir: Path, tmp_path: Path) -> None:
    result = package(
        source_dir, tmp_path / "b", PackageOptions(weights="q8", quality_gate=False, device="iPhone15,2", kv="k8v4")
    )
    p = result.manifest.prediction
    assert p is not None and p.fits and not p.forced
    assert p.max_context == result.kvcache.max_context > 0
    assert 0 < result.kvcache.memory_limit_bytes < p.limit_bytes
    assert p.kv_bytes_per_token > 0 and p.weights_bytes > 0


def test_cli_errors_are_clear(q4_bundle: Path, tmp_path: Path) -> None:
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\x00" * 64)
    cases = [
        (["package", "-o", str(q4_bundle)], BundleExistsError.exit_code, "already exists; use --replace"),
        (["package", str(not_gguf), "-o", str(tmp_path / "o1")], 3, "not a GGUF file"),
        (["package", str(tmp_path / "missing"), "-o", str(tmp_path / "o2")], 3, "model not found"),
        (["package", "--kv", "k7v4", "-o", str(tmp_path / "o3")], 5, "k7v4"),
    ]
    for args, code, text in cases:
        proc = subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True)
        assert proc.returncode == code, (args, proc.stderr)
        assert text in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_top_layer_keys_are_measured_and_written_per_layer(source_dir: Path, tmp_path: Path) -> None:
    """`--kv k4v4+k8@top2`: the two layers whose keys suffer most at 4 bits (measured on the source) get 8-bit
    keys in kvcache.json; the manifest's scheme names them, and the bundle verifies. A tiny model of SmolLM2's
    vocabulary with four layers: the measurement runs on whatever the source is."""
    tiny = tiny_source(
        tmp_path / "tiny", source_dir / "tokenizer.json", "llama", num_hidden_layers=4, vocab_size=49152, head_dim=64
    )
    out = tmp_path / "top2"
    result = package(tiny, out, PackageOptions(weights="q8", kv="k4v4+k8@top2", quality_gate=False))
    kv = load_model_file(KVCacheConfig, out / "kvcache.json")
    wide = [e.layer for e in kv.layers if e.key_bits == 8]
    assert len(wide) == 2 and all(e.key_bits == 4 and e.value_bits == 4 for e in kv.layers if e.layer not in wide)
    assert result.manifest.recipe.kv_scheme == result.manifest.recipe.kv == f"k4v4+k8@{wide[0]}.{wide[1]}"
    verify_bundle(out)


def test_the_manifest_records_the_kv_spec_whole(source_dir: Path, tmp_path: Path) -> None:
    """`--kv k8v4+rot+s4+w64`: the manifest records the spec as given (kv_scheme is its memory layout alone), and
    it parses back to what kvcache.json holds."""
    tiny = tiny_source(tmp_path / "tiny", source_dir / "tokenizer.json", "llama", vocab_size=49152, head_dim=64)
    result = package(tiny, tmp_path / "b", PackageOptions(weights="q8", kv="k8v4+rot+s4+w64", quality_gate=False))
    recipe = result.manifest.recipe
    assert result.manifest.schema_version == 3
    assert (recipe.kv, recipe.kv_scheme) == ("k8v4+rot+s4+w64", "k8v4")
    spec, written = parse_kv(recipe.kv), load_model_file(KVCacheConfig, tmp_path / "b" / "kvcache.json")
    assert (written.scheme, written.rotation, written.sink_tokens, written.recent_tokens) == (
        spec.scheme,
        "hadamard",
        spec.sink_tokens,
        spec.recent_tokens,
    )
    # A bundle written before the field: schema 2, no `kv`; it reads, the spec unknown beyond its scheme.
    data = json.loads((tmp_path / "b" / "manifest.json").read_text())
    data["schema"] = 2
    del data["recipe"]["kv"]
    older = Manifest.model_validate(data)
    assert older.schema_version == 2 and older.recipe.kv == "" and older.recipe.kv_scheme == "k8v4"


def _llama(head_dim: int, model_type: str = "llama") -> dict[str, object]:
    return {
        "model_type": model_type,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 256,
        "vocab_size": 256,
        "rms_norm_eps": 1e-5,
        "head_dim": head_dim,
    }


@pytest.mark.parametrize(
    ("head_dim", "kv", "expected"),
    [
        (64, "k8v4", "hadamard"),
        (128, "k4v4", "hadamard"),
        (80, "k8v4", "none"),  # 80 is not a power of two: no Hadamard matrix of that size is its own inverse
        (64, "fp16", "none"),  # nothing quantized, nothing to spread
        (64, "k8v8", "none"),  # 8-bit both ways loses 0.1 %: mlx-lm's own cache stays
    ],
)
def test_auto_rotation_applies_where_the_transform_does(head_dim: int, kv: str, expected: str, tmp_path: Path) -> None:
    from kvrig.bundle.options import auto_rotation
    from kvrig.recipes import parse_kv

    assert auto_rotation(parse_kv(kv), _llama(head_dim), tmp_path / "config.json") == expected


@pytest.mark.parametrize(("head_dim", "expected"), [(64, "k8v4+rot"), (80, "k8v4")])
def test_auto_kv_is_k8v4_rotated_where_the_model_allows(head_dim: int, expected: str, tmp_path: Path) -> None:
    from kvrig.bundle.options import resolve_kv

    assert resolve_kv("auto", _llama(head_dim), tmp_path / "config.json").name == expected
    # a spec as written is taken as written: no rotation added, none removed
    assert resolve_kv("k8v4", _llama(head_dim), tmp_path / "config.json").rotation == "none"
    assert resolve_kv("k8v4+rotk", _llama(head_dim), tmp_path / "config.json").rotation == "hadamard_keys"


def test_auto_rotation_is_none_where_attention_cannot_read_the_cache(tmp_path: Path) -> None:
    from kvrig.bundle.options import auto_rotation
    from kvrig.kvcache.families import NO_QUANTIZED_ATTENTION
    from kvrig.recipes import parse_kv

    assert "gemma2" in NO_QUANTIZED_ATTENTION
    config = {**_llama(64, "gemma2"), "query_pre_attn_scalar": 64}
    assert auto_rotation(parse_kv("k8v4"), config, tmp_path / "config.json") == "none"


def test_top_layer_keys_on_dims_the_group_does_not_divide_are_refused_before_measuring(
    source_dir: Path, tmp_path: Path
) -> None:
    tiny = tiny_source(tmp_path / "tiny", source_dir / "tokenizer.json", "llama", vocab_size=49152)  # head dim 32
    args = [
        "package",
        str(tiny),
        "--weights",
        "q8",
        "--kv",
        "k4v4+k8@top2",
        "--no-quality-gate",
        "-o",
        str(tmp_path / "b"),
    ]
    done = subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True)
    assert done.returncode == QuantizationError.exit_code, done.stderr
    assert "head dim 32 is not divisible by KV group size 64" in done.stderr and "use group size 32" in done.stderr


def test_a_distilled_recipe_packages_with_its_recipes_arrays(source_dir: Path, tmp_path: Path) -> None:
    """`--weights gpx-q4+kd2`: the manifest records the recipe as given, the bundle verifies, and its arrays are
    gpx-q4's (same names, shapes, dtypes and packed levels: the plan's bytes) with distilled scales."""
    tiny = tiny_source(tmp_path / "tiny", source_dir / "tokenizer.json", "llama", vocab_size=49152, head_dim=64)
    bundles = {}
    for weights in ("gpx-q4", "gpx-q4+kd2"):
        result = package(tiny, tmp_path / weights, PackageOptions(weights=weights, kv="k8v4", quality_gate=False))
        assert result.manifest.recipe.weights == weights
        verify_bundle(tmp_path / weights)
        bundles[weights] = mx.load(str(tmp_path / weights / "model.safetensors"))
    plain, distilled = bundles["gpx-q4"], bundles["gpx-q4+kd2"]
    assert {k: (v.shape, v.dtype) for k, v in distilled.items()} == {k: (v.shape, v.dtype) for k, v in plain.items()}
    assert all(
        mx.array_equal(distilled[k], plain[k]) for k in plain if k.endswith(".weight") and plain[k].dtype == mx.uint32
    )
    assert not all(mx.array_equal(distilled[k], plain[k]) for k in plain if k.endswith(".scales"))


def test_a_family_the_app_keeps_unquantized_takes_no_quantized_kv() -> None:
    """Gemma 3n's KV-shared layers read their owner's cache as float arrays in MLX Swift, so the app keeps its KV
    unquantized (KvrigCore's CachePlan.keepsKVUnquantized, checked against this list in test_core_swift): a
    quantized spec would plan bytes the phone never holds."""
    from kvrig.bundle.options import check_app_kv
    from kvrig.exceptions import KVSchemeError
    from kvrig.recipes import parse_kv

    with pytest.raises(KVSchemeError, match=r"gemma3n.*--kv fp16"):
        check_app_kv("gemma3n", parse_kv("k8v4"))
    check_app_kv("gemma3n", parse_kv("fp16"))
    check_app_kv("llama", parse_kv("k8v4"))


@pytest.mark.skipif(sys.platform not in ("linux", "darwin"), reason="an atomic exchange is Linux's and macOS's")
def test_an_existing_bundle_is_swapped_for_the_new_one_in_one_rename(tmp_path: Path) -> None:
    """`--replace` puts the new bundle in place with one atomic exchange (renameat2 on Linux, renamex_np on macOS):
    no moment with no bundle at the path, and the old one removed after."""
    from kvrig.fileio import exchange, swap_in

    old, new = tmp_path / "bundle", tmp_path / ".bundle.partial"
    old.mkdir()
    (old / "manifest.json").write_text("old")
    new.mkdir()
    (new / "manifest.json").write_text("new")
    if not exchange(new, old):
        pytest.skip(f"the file system of {tmp_path} has no atomic exchange (swap_in renames twice there)")
    assert (old / "manifest.json").read_text() == "new" and (new / "manifest.json").read_text() == "old"
    assert exchange(new, old) is True  # and back
    swap_in(new, old)
    assert (old / "manifest.json").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]
