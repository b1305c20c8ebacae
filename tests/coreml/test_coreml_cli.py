"""`kvrig export coreml` and `kvrig plan --backend coreml` from the command line: output, refusals and their
exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvrig.cli import main
from kvrig.coreml.export import ExportResult
from kvrig.exceptions import CoreMLExportError, CoreMLToolsMissingError, CoreMLUnsupportedError


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _config_only_bundle(tmp_path: Path, smol_bundle: Path, **changes: object) -> Path:
    """The bundle's manifest and an edited config.json: the export refuses on the config before any weight."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    shutil.copy(smol_bundle / "manifest.json", bundle)
    cfg = json.loads((smol_bundle / "config.json").read_text())
    for key, value in changes.items():
        if key == "bits":
            cfg["quantization"]["bits"] = value
        else:
            cfg[key] = value
    (bundle / "config.json").write_text(json.dumps(cfg))
    return bundle


def test_export_json_and_existing_output(
    tiny_exports: dict[str, ExportResult], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tiny_exports["qwen3-q8"].bundle
    out = tmp_path / "Q.mlpackage"
    code, stdout, _ = _run(["export", "coreml", bundle, "-o", str(out), "--context", "32", "--json"], capsys)
    assert code == 0
    data = json.loads(stdout)
    assert data["context"] == 32 and data["context_source"] == "--context"
    assert data["package"]["weight_file_bytes"] == (out / "Data/com.apple.CoreML/weights/weight.bin").stat().st_size
    assert {s["shape"][2] for s in data["package"]["states"]} == {32}
    code, _, err = _run(["export", "coreml", bundle, "-o", str(out)], capsys)
    assert code == CoreMLExportError.exit_code == 41
    assert str(out) in err and "--replace" in err
    code, stdout, _ = _run(["export", "coreml", bundle, "-o", str(out), "--replace"], capsys)
    assert code == 0 and "context 64 (kvcache.json)" in stdout


def test_export_prints_nothing_of_the_libraries_it_imports(
    tiny_exports: dict[str, ExportResult], tmp_path: Path
) -> None:
    """coremltools imports transformers, which advised installing PyTorch on stderr at every export; coremltools
    itself warns of each Core ML framework proxy Linux lacks. Neither says anything about the export."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}  # mlx-lm sets it here
    bundle = tiny_exports["qwen3-q8"].bundle
    args = ["export", "coreml", str(bundle), "-o", str(tmp_path / "Q.mlpackage"), "--context", "32"]
    done = subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert "weight.bin" in done.stdout


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"model_type": "gemma2"}, "model_type"),
        ({"bits": 6}, "quantization.bits"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"layer_types": ["sliding_attention"] * 30}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_refusals_name_the_file_and_field(
    changes: dict[str, object],
    field: str,
    smol_bundle: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle = _config_only_bundle(tmp_path, smol_bundle, **changes)
    code, _, err = _run(["export", "coreml", str(bundle), "-o", str(tmp_path / "M.mlpackage")], capsys)
    assert code == CoreMLUnsupportedError.exit_code == 39
    assert str(bundle / "config.json") in err and f"field '{field}'" in err
    assert not (tmp_path / "M.mlpackage").exists()


def test_context_and_target_are_checked(smol_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "M.mlpackage"
    code, _, err = _run(["export", "coreml", str(smol_bundle), "-o", str(out), "--context", "100000"], capsys)
    assert code == 39 and "context 100000" in err
    code, _, err = _run(["export", "coreml", str(smol_bundle), "-o", str(out), "--target", "iOS17"], capsys)
    assert code == 39 and "iOS17" in err
    assert not out.exists()


def test_without_coremltools_exit_40(smol_bundle: Path, tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['coremltools'] = None\n"
        "from kvrig.cli import main\n"
        f"main(['export', 'coreml', {str(smol_bundle)!r}, '-o', {str(tmp_path / 'M.mlpackage')!r}])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == CoreMLToolsMissingError.exit_code == 40
    assert "kvrig[coreml]" in proc.stderr


def test_plan_backend_coreml(capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = _run(
        ["plan", "--device", "iPhone16,1", "--backend", "coreml", "--contexts", "256,4096", "--json"], capsys
    )
    assert code == 0
    data = json.loads(stdout)
    assert data["backend"] == "coreml" and data["bits"] == 4 and data["device"] == "iphone-15-pro"
    # SmolLM2: 30 layers × 3 KV heads × 64 dims, keys and values in fp16.
    assert data["state_bytes_per_token"] == 30 * 3 * 64 * 2 * 2
    assert data["state_bytes"]["4096"] == 4096 * data["state_bytes_per_token"]
    code, _, err = _run(["plan", "--device", "iPhone16,1", "--backend", "coreml", "--weights", "q6"], capsys)
    assert code == 39 and "6-bit" in err
    code, stdout, _ = _run(["plan", "--device", "iPhone16,1", "--backend", "coreml"], capsys)
    assert code == 0 and "weight.bin" in stdout


def test_plan_backend_coreml_on_a_mixed_bundle_is_what_the_export_wrote(
    tiny_exports: dict[str, ExportResult], capsys: pytest.CaptureFixture[str]
) -> None:
    """gpx-4.6 keeps some layers in groups of 32: planned as q4 g64 it read as fitting a smaller program than the
    export writes (whose weight.bin is the independent count here)."""
    result = tiny_exports["llama-gpx-4.6"]
    args = ["plan", result.bundle, "-d", "iPhone16,1", "--backend", "coreml"]
    code, stdout, _ = _run([*args, "--json"], capsys)
    assert code == 0
    data = json.loads(stdout)
    assert (
        data["weight_file_bytes"] == (Path(result.output) / "Data/com.apple.CoreML/weights/weight.bin").stat().st_size
    )
    assert data["own_layers"] > 0
    code, _, err = _run([*args, "--weights", "q8"], capsys)  # a bundle is planned as it is quantized
    assert code == CoreMLUnsupportedError.exit_code and "field 'weights'" in err


def test_plan_backend_coreml_takes_the_limit_asked_for_and_refuses_what_it_cannot_honour(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from kvrig.profiles import load_profile

    profile = load_profile("iPhone16,1")
    for limit, expected in (("entitled", profile.limit_entitled), ("default", profile.limit_default)):
        code, stdout, _ = _run(["plan", "-d", "iPhone16,1", "--backend", "coreml", "--limit", limit, "--json"], capsys)
        assert code == 0
        assert json.loads(stdout)["limit_kind"] == limit and json.loads(stdout)["limit_bytes"] == expected
    # MLX-plan options (files that do not exist among them) are refused by name, not dropped
    missing = str(tmp_path / "nonexistent.json")
    args = ["--calibration", missing, "--margin", "0.2", "--kv", "k8v4", "--cap", "none"]
    code, stdout, err = _run(["plan", "-d", "iPhone16,1", "--backend", "coreml", *args], capsys)
    assert code == 2 and stdout == ""
    assert all(option in err for option in ("--calibration", "--margin", "--kv", "--cap"))


def test_a_weight_the_program_would_drop_is_refused(
    tiny_exports: dict[str, ExportResult], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    import mlx.core as mx

    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_exports["qwen2-q4"].bundle, bundle)
    mx.save_safetensors(
        str(bundle / "extra.safetensors"), {"model.layers.0.mlp.extra.weight": mx.ones((4,), mx.float16)}
    )
    code, _, err = _run(["export", "coreml", str(bundle), "-o", str(tmp_path / "M.mlpackage")], capsys)
    assert code == 39 and "model.layers.0.mlp.extra.weight" in err
    assert not (tmp_path / "M.mlpackage").exists()


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        ({"config.json": "{bad"}, "not valid JSON"),
        ({"config.json": "[1]"}, "not a JSON mapping"),
        ({"config.json": {"quantization": "q8"}}, "field 'quantization'"),
        ({"kvcache.json": '{"scheme":'}, "kvcache.json"),
    ],
)
def test_a_damaged_bundle_is_named_not_a_crash(
    tiny_exports: dict[str, ExportResult],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: dict[str, str | dict[str, str]],
    field: str,
) -> None:
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(tiny_exports["qwen3-q8"].bundle, bundle)
    for name, change in damage.items():
        edited = {**json.loads((bundle / name).read_text()), **change} if isinstance(change, dict) else None
        (bundle / name).write_text(json.dumps(edited) if edited is not None else str(change))
    code, _, err = _run(["export", "coreml", str(bundle), "-o", str(tmp_path / "Q.mlpackage")], capsys)
    assert code == 3 and field in err, err
    assert not (tmp_path / "Q.mlpackage").exists()


def test_weights_mlx_cannot_load_are_the_bundles_error(
    tiny_exports: dict[str, ExportResult], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A weights file cut short reached MLX's loader unguarded: exit 70. It is the bundle's error (7), as `kvrig run`
    says, naming the file; nothing is written."""
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(tiny_exports["qwen3-q8"].bundle, bundle)
    weights = next(bundle.glob("*.safetensors"))
    with weights.open("r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    code, _, err = _run(["export", "coreml", str(bundle), "-o", str(tmp_path / "Q.mlpackage")], capsys)
    assert code == 7 and f"{weights}: MLX cannot load it" in err, err
    assert not (tmp_path / "Q.mlpackage").exists()


def test_an_output_that_is_no_package_is_refused_before_the_export(
    tiny_exports: dict[str, ExportResult], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tiny_exports["qwen3-q8"].bundle
    mine = tmp_path / "Mine.mlpackage"
    mine.write_text("a file of mine")
    code, _, err = _run(["export", "coreml", bundle, "-o", str(mine), "--replace"], capsys)
    assert code == 41 and "not a Core ML package" in err and mine.read_text() == "a file of mine"
    code, _, err = _run(["export", "coreml", bundle, "-o", str(mine / "Q.mlpackage")], capsys)
    assert code == 41 and "is a file, not a folder" in err
