"""The lab file (schema, errors naming file and field, the shipped example) and the gates, without a phone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvrig.exceptions import SchemaError
from kvrig.lab.gates import decode_tps_at, evaluate, failures, prediction_error
from kvrig.schemas.lab import Gates, load_lab, slug
from kvrig.schemas.results import Confirmation, DeviceRef, Prediction, SoakResult, TpsPoint

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = "schema: 1\nmatrix:\n  - app_id: dev.kvrig.soak\n    schemes: [fp16]\n"


def test_minimal_lab_gets_defaults(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text(MINIMAL)
    lab = load_lab(path)
    assert [d.udid for d in lab.devices] == ["any"]
    (entry,) = lab.matrix
    assert entry.label == "dev.kvrig.soak" and [s.name for s in entry.schemes] == ["fp16"]
    assert lab.threshold.confirm_runs == 1 and lab.gates == Gates()


def test_an_entry_runs_each_residency_it_lists(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text(MINIMAL + "    residencies: [loaded, mapped]\n")
    (entry,) = load_lab(path).matrix
    assert entry.runs_residencies == ["loaded", "mapped"]
    path.write_text(MINIMAL)
    (entry,) = load_lab(path).matrix
    assert entry.residencies is None and entry.runs_residencies == [None]  # one run, as the bundle says


def test_on_critical_is_the_labs_unless_an_entry_sets_its_own(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text(MINIMAL)
    lab = load_lab(path)
    assert lab.on_critical == "stop_and_save" and lab.on_critical_for(lab.matrix[0]) == "stop_and_save"
    path.write_text(MINIMAL + "  - app_id: dev.kvrig.other\n    schemes: [fp16]\n    on_critical: stop_and_save\n")
    path.write_text(path.read_text() + "on_critical: continue\n")
    lab = load_lab(path)
    assert [lab.on_critical_for(e) for e in lab.matrix] == ["continue", "stop_and_save"]


def test_example_lab_loads_with_paths_from_its_folder() -> None:
    lab = load_lab(ROOT / "examples" / "lab-virtual.yaml")
    assert {d.profile for d in lab.devices} == {"iphone-15-pro", "iphone-13-pro"}
    testapp = lab.matrix[0]
    assert testapp.model == ROOT / "examples" / "testapp-model" / "config.json" and testapp.model.exists()
    assert testapp.ipa == ROOT / "examples" / "KVSoak.ipa"
    assert [s.name for s in testapp.schemes] == ["fp16", "fp16-kv4"]
    assert testapp.schemes[1].arguments == ["--kv-heads", "4"]
    assert lab.gates.min_decode_tps_at == {512: 1.0}


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        (MINIMAL + "    bogus: 1\n", "matrix.0.bogus", "unknown key"),
        (MINIMAL.replace("matrix:", "matrixx:"), "matrixx", "unknown key; did you mean 'matrix'?"),
        # An optional key misspelt at any depth: the object's own keys, and the one most likely meant.
        (
            MINIMAL + "gates: {min_max_safe_contxt: 512}\n",
            "gates.min_max_safe_contxt",
            "unknown key; did you mean 'min_max_safe_context'? (expected one of min_max_safe_context,",
        ),
        (MINIMAL + "    plan: {margn: 0.1}\n", "matrix.0.plan.margn", "did you mean 'margin'?"),
        (MINIMAL + "gates: {min_max_safe_context: -5}\n", "gates.min_max_safe_context", "greater than or equal"),
        (MINIMAL.replace("schema: 1", "schema: 2"), "schema", "Input should be 1"),
        ("schema: 1\nmatrix: []\n", "matrix", "at least 1"),
        (MINIMAL + "threshold: {confirm_runs: 1, max_attempts: 0}\n", "threshold.max_attempts", "greater than"),
        (MINIMAL.replace("[fp16]", "[fp16, fp16]"), "matrix.0", "scheme names repeat"),
        # one folder on macOS's file systems, which ignore case; one slug whatever the case
        (MINIMAL.replace("[fp16]", "[Base, base]"), "matrix.0", "scheme names repeat"),
        (MINIMAL.replace("[fp16]", "[k8 v4, k8-v4]"), "matrix.0", "scheme names repeat"),
        (
            "schema: 1\nmatrix:\n  - {name: Qwen, app_id: a.b, schemes: [fp16]}\n"
            "  - {name: qwen, app_id: a.b, schemes: [fp16]}\n",
            None,
            "matrix entries need distinct names",
        ),
        (MINIMAL + "    residencies: [loaded, loaded]\n", "matrix.0", "residencies repeat"),
        (MINIMAL + "    residencies: [wired]\n", "matrix.0.residencies.0", "'loaded' or 'mapped'"),
        (MINIMAL + "    residencies: []\n", "matrix.0.residencies", "at least 1"),
        (MINIMAL + "    backend: coreml\n    residencies: [mapped]\n", "matrix.0", "the MLX app's"),
        (MINIMAL + "    on_critical: stop\n", "matrix.0.on_critical", "'stop_and_save' or 'continue'"),
        (MINIMAL + "on_critical: keep_going\n", "on_critical", "'stop_and_save' or 'continue'"),
    ],
)
def test_bad_lab_file_names_file_and_field(tmp_path: Path, text: str, field: str | None, words: str) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    with pytest.raises(SchemaError) as info:
        load_lab(path)
    assert info.value.file == str(path) and info.value.field == field
    assert words in str(info.value)


def test_cli_bad_lab_file_exit_code_and_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text("schema: 1\nmatrix: [ {app_id: x, schemes: [fp16]\n")  # unclosed
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "lab", "run", str(path), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 3
    assert str(path) in proc.stderr and "not valid YAML" in proc.stderr and "Traceback" not in proc.stderr


def test_slug_keeps_names_inside_the_output_folder() -> None:
    for name in ("../../etc", "/abs/path", "..", ".hidden", "a b/c"):
        s = slug(name)
        assert "/" not in s and not s.startswith(".") and s not in ("", "..")


# --- gates ----------------------------------------------------------------------------------------------------


def _result(**kw: object) -> SoakResult:
    return SoakResult.model_validate(
        {"run_id": "r", "device": DeviceRef(udid="u"), "app_id": "a", "scheme": "fp16", **kw}
    )


CURVE = [TpsPoint(context_tokens=c, decode_tps=t) for c, t in ((512, 40.0), (1024, 30.0), (2048, 10.0))]


def test_decode_tps_at_interpolates_between_measurements() -> None:
    assert decode_tps_at(CURVE, 1024) == 30.0
    assert decode_tps_at(CURVE, 1536) == 20.0  # halfway between 30 at 1024 and 10 at 2048
    assert decode_tps_at(CURVE, 256) == 40.0  # before the first point: the first measurement
    assert decode_tps_at(CURVE, 4096) is None  # never measured


def test_gates_pass_fail_and_not_evaluated() -> None:
    r = _result(outcome="jetsam", max_safe_context=2048, tps_curve=CURVE, predicted=Prediction(max_context=1600))
    gates = Gates(min_max_safe_context=2048, min_decode_tps_at={1536: 25.0, 4096: 1.0}, max_predicted_error=0.25)
    checks = {c.gate: c for c in evaluate(r, gates)}
    assert checks["min_max_safe_context"].status == "passed"
    assert checks["min_decode_tps_at[1536]"].status == "failed" and checks["min_decode_tps_at[1536]"].measured == 20.0
    assert checks["min_decode_tps_at[4096]"].status == "failed"  # the run never got there
    assert checks["max_predicted_error"].status == "failed"  # (2048 - 1600) / 1600 = +28%
    assert prediction_error(r) == pytest.approx(0.28)

    completed = _result(outcome="completed", max_safe_context=1024, predicted=Prediction(max_context=1600))
    (check,) = evaluate(completed, Gates(max_predicted_error=0.25))
    assert check.status == "not_evaluated"  # the limit was never found


@pytest.mark.parametrize(
    ("outcome", "held", "predicted"),
    [("jetsam", 4096, 0), ("completed", 65536, 4096), ("completed", 512, 0)],
    ids=["nothing-fits-but-it-held", "held-far-past-the-plan", "held-without-a-plan-fitting"],
)
def test_a_prediction_the_run_proves_wrong_fails_its_gate(outcome: str, held: int, predicted: int) -> None:
    """A plan of 0 tokens against a phone that held 4096 is as wrong as a plan can be, and a run that held 16x
    the plan without finding the limit already proves it wrong: neither is 'not evaluated'."""
    r = _result(outcome=outcome, max_safe_context=held, predicted=Prediction(max_context=predicted))
    (check,) = evaluate(r, Gates(max_predicted_error=0.35))
    assert check.status == "failed", check.message


def test_failures_cover_outcomes_confirmations_and_gates() -> None:
    lost = _result(outcome="device_lost", outcome_detail="gone")
    assert [k for k, _ in failures(lost)] == ["device_lost"]
    unconfirmed = _result(
        outcome="jetsam", confirmations=[Confirmation(run_id="r-c1", max_tokens=512, outcome="crash")]
    )
    assert [k for k, _ in failures(unconfirmed)] == ["crash"]
    assert failures(_result(outcome="jetsam")) == []


def test_lab_modules_do_not_import_mlx_or_matplotlib() -> None:
    code = (
        "import sys, kvrig.lab, kvrig.lab.report, kvrig.lab.junit, kvrig.cli.lab\n"
        "from kvrig.cli import main\n"
        "try:\n    main(['lab', 'run', '--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = {'mlx', 'mlx_lm', 'matplotlib'}\n"
        "print('HEAVY=' + ','.join(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "LAB_FILE" in out and out.rstrip().endswith("HEAVY=")


@pytest.mark.parametrize("shard", ["x/y", "0/2", "1"])
def test_a_results_file_whose_shard_is_not_k_of_n_is_refused(tmp_path: Path, shard: str) -> None:
    """`kvrig lab merge` reads K/N from each folder's results.json; anything else is the file's error (exit 3),
    not a ValueError in the merge."""
    from kvrig.lab.merge import merge_folders

    folder = tmp_path / "s1"
    folder.mkdir()
    record = {"schema": 4, "tool_version": "t", "runs": [], "lab": {"name": "ci", "shard": shard}}
    (folder / "results.json").write_text(json.dumps(record))
    with pytest.raises(SchemaError) as caught:
        merge_folders([folder], tmp_path / "merged")
    assert caught.value.field == "lab.shard" and not (tmp_path / "merged").exists()
