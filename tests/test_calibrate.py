"""`kvrig calibrate` on a real soak: SmolLM2 packaged, its app built for the virtual iPhone, soaked into jetsam
on a phone started with a known baseline that differs from the profile's estimate.

The expected baseline is the one the virtual iPhone was started with (independent of the calibration code);
the expected max context is the one the soak measured."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvrig.appgen.render import AppOptions, render_app
from kvrig.appgen.virtual_ipa import build_virtual_ipa
from kvrig.calibration import calibrate
from kvrig.cli import cli, main
from kvrig.device.deploy import deploy
from kvrig.exceptions import CalibrationError, OutputWriteError
from kvrig.planner import plan as make_memory_plan
from kvrig.profiles import AppMemoryLimit, SourcedInt, load_profile
from kvrig.reports.telemetry import read_telemetry
from kvrig.schemas import load_model_file
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig
from kvrig.schemas.results import ResultsFile, SoakResult
from kvrig.soaking.driver import SoakOptions, soak
from kvrig.soaking.plan import make_plan
from kvrig.virtual.host import EmulatorHost
from tests.bundle_fixtures import smollm2_q4_k8v4

PROFILE = "iPhone16,1"
APP_ID = "dev.kvrig.calibrate"
TRUE_BASELINE = 40 * 1024 * 1024  # what the phone is started with; the profile estimates 100 MiB
ROOM_TOKENS = 512  # killed in the third 256-token step: two points for the fit


@dataclass
class Soaked:
    bundle: Path
    results: Path
    run: SoakResult
    limit: int
    vocab_size: int


@pytest.fixture(scope="module")
def soaked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Soaked]:
    bundle = smollm2_q4_k8v4(tmp_path_factory)
    root = tmp_path_factory.mktemp("calibrate")
    kv = load_model_file(KVCacheConfig, bundle / KVCACHE_NAME)
    # The limit: the plan's own peak footprint at ROOM_TOKENS on a phone with the true baseline (weights, KV,
    # buffer cache, the growth copy and the prefill transient of the app's own chunks), as `kvrig demo` sizes it.
    sizing = make_memory_plan(
        bundle,
        PROFILE,
        schemes=["k8v4"],
        weights="q4",
        margin=0.0,
        max_context_cap=ROOM_TOKENS,
        baseline_bytes=TRUE_BASELINE,
        prefill_step=kv.prefill_step_size,
        buffer_cache_bytes=kv.buffer_cache_limit_bytes,
        backend="cpu",  # the virtual iPhone runs MLX on this host's CPU
    )
    assert sizing.max_context["k8v4"] == ROOM_TOKENS, sizing.max_context
    limit = sizing.budget_at_max_context["k8v4"].total_bytes
    project = render_app(bundle, root / "project", AppOptions(name="Calibrate", bundle_id=APP_ID)).project
    ipa = build_virtual_ipa(project, root)
    address = f"/tmp/kvrig-cal-{os.getpid()}.sock"
    with EmulatorHost(address) as host:
        device = host.add_device(root / "phone", profile=PROFILE, limit_bytes=limit, baseline_bytes=TRUE_BASELINE)
        udid = device.identity.udid
        asyncio.run(deploy(bundle, ipa=ipa, udid=udid, usbmux_address=address))
        plan = make_plan(max_tokens=4096, step_tokens=256, decode_tokens=2, scheme="k8v4")
        plan = plan.model_copy(update={"on_critical": "continue"})
        options = SoakOptions(poll_interval_s=0.2, hang_after_s=90, report_wait_s=10, bundle=bundle.name)
        try:
            run = asyncio.run(soak(APP_ID, plan, root / "soak", udid=udid, options=options, usbmux_address=address))
        finally:
            host.run(device.apps.kill_all())
    vocab = json.loads((bundle / "config.json").read_text())["vocab_size"]
    yield Soaked(bundle, root / "soak" / "results.json", run, limit, vocab)


def test_calibrated_baseline_is_the_phones(soaked: Soaked) -> None:
    assert soaked.run.outcome == "jetsam", soaked.run.outcome_detail
    calibration = calibrate([soaked.results], bundle=soaked.bundle)
    (name,) = calibration.profiles
    entry = calibration.profiles[name]
    assert name == load_profile(PROFILE).name
    assert entry.points == len([p for p in soaked.run.tps_curve if p.phys_footprint_bytes]) >= 2
    # Between steps MLX holds a little beyond weights and KV (the last logits, generate_step's arrays); the
    # planner has no term for it, so the calibrated baseline carries it. Expected from the app's own telemetry
    # (MLX active bytes in the phone's format, less the exact weights and the KV it reported).
    steps = [s for r in read_telemetry(soaked.results.parent / "telemetry.jsonl").runs for s in r.steps]
    weights = entry.measurements[0].weights_bytes
    extra = statistics.median((s.mlx_active_bytes or 0) - (s.kv_bytes or 0) - weights for s in steps)
    assert 0 <= extra < 4 * 1024 * 1024
    assert abs(entry.baseline_bytes - (TRUE_BASELINE + extra)) <= entry.spread_bytes + 16384
    assert entry.profile_baseline_bytes == load_profile(PROFILE).baseline != TRUE_BASELINE


def test_calibrated_plan_is_closer_to_the_soak(soaked: Soaked, tmp_path: Path) -> None:
    runner = CliRunner()
    cal = tmp_path / "calibration.json"
    done = runner.invoke(cli, ["calibrate", str(soaked.results), "--bundle", str(soaked.bundle), "-o", str(cal)])
    assert done.exit_code == 0, done.output
    # The phone the soak ran on: the profile with the limit the virtual iPhone was given.
    profile = load_profile(PROFILE)
    given = SourcedInt(value=soaked.limit, basis="reported", source="test: the virtual iPhone's limit")
    small = profile.model_copy(update={"app_memory_limit": AppMemoryLimit(default_bytes=given)})
    profile_file = tmp_path / "small.yaml"
    profile_file.write_text(json.dumps(small.model_dump(mode="json", by_alias=True)))

    def predicted(*extra: str) -> dict:
        args = ["plan", str(soaked.bundle), "-d", str(profile_file), "--schemes", "k8v4", "--margin", "0"]
        args += ["--mlx-backend", "cpu"]
        done = runner.invoke(cli, [*args, "--limit", "default", "--json", *extra])
        assert done.exit_code == 0, done.output
        return json.loads(done.output)

    plain, calibrated = predicted(), predicted("--calibration", str(cal))
    measured = soaked.run.max_context_reached
    assert measured is not None and measured > 0
    assert plain["runtime"]["baseline_calibrated_from"] is None
    assert calibrated["runtime"]["baseline_calibrated_from"] == str(cal)
    assert any("calibrated" in note for note in calibrated["notes"])
    error = abs(calibrated["max_context"]["k8v4"] - measured)
    assert error < abs(plain["max_context"]["k8v4"] - measured)


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Runs `kvrig` as the shell does: errors become a message and an exit code."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return int(exited.value.code or 0), err


def test_results_without_telemetry_points(soaked: Soaked, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = ResultsFile.model_validate(json.loads(soaked.results.read_text()))
    bare = data.model_copy(update={"runs": [r.model_copy(update={"tps_curve": []}) for r in data.runs]})
    path = tmp_path / "results.json"
    path.write_text(json.dumps(bare.model_dump(mode="json", by_alias=True)))
    code, err = _fails(["calibrate", str(path), "-o", str(tmp_path / "c.json")], capsys)
    assert code == CalibrationError.exit_code
    assert str(path) in err and "phys_footprint_bytes" in err


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"device": {"udid": "u", "profile": "iphone-99"}}, "runs.0.device.profile", "iphone-99"),
        ({"weights_residency": "mapped", "mapped_weight_bytes": None}, "runs.0.mapped_weight_bytes", "how many"),
        # a footprint below the app's own weights and KV: a negative baseline, which plans would add as room
        ({"tps_curve": "footprint of 1 byte"}, "runs.0.tps_curve.0.phys_footprint_bytes", "another bundle"),
    ],
)
def test_a_run_the_plan_cannot_take_is_refused_naming_the_results_file_and_field(
    soaked: Soaked, tmp_path: Path, change: dict, field: str, words: str
) -> None:
    data = json.loads(soaked.results.read_text())
    if change.get("tps_curve") == "footprint of 1 byte":
        data["runs"][0]["tps_curve"][0]["phys_footprint_bytes"] = 1
    else:
        data["runs"][0].update(change)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError) as caught:
        calibrate([path], bundle=soaked.bundle)
    assert str(path) in str(caught.value) and f"field '{field}'" in str(caught.value) and words in str(caught.value)


def test_the_kv_spec_is_the_one_the_app_ran_whatever_the_run_is_called(soaked: Soaked, tmp_path: Path) -> None:
    """A lab scheme's name may be any label: the app runs its bundle's kvcache.json, and that is what is counted. A
    run with no bundle (`--model`) is counted by its own scheme, which must then be a KV spec."""
    data = json.loads(soaked.results.read_text())
    data["runs"][0]["scheme"] = "baseline"
    labelled = tmp_path / "labelled.json"
    labelled.write_text(json.dumps(data))

    def counted(results: Path) -> list[tuple[str, int, int]]:
        cal = calibrate([results], bundle=soaked.bundle)
        return [(p.scheme, p.context_tokens, p.kv_bytes) for c in cal.profiles.values() for p in c.measurements]

    kv = json.loads((soaked.bundle / "kvcache.json").read_text())["scheme"]
    assert counted(labelled) == counted(soaked.results)
    assert {scheme for scheme, _, _ in counted(labelled)} == {kv}

    data["runs"][0].update(scheme="k9v9", bundle=None)
    misspelt = tmp_path / "misspelt.json"
    misspelt.write_text(json.dumps(data))
    with pytest.raises(CalibrationError) as caught:
        calibrate([misspelt], model=soaked.bundle)
    assert str(misspelt) in str(caught.value) and "field 'runs.0.scheme'" in str(caught.value)
    assert "k9v9" in str(caught.value)


def test_bundle_not_found(soaked: Soaked, tmp_path: Path) -> None:
    # The results alone, away from the bundle they name.
    path = tmp_path / "results.json"
    path.write_text(soaked.results.read_text())
    with pytest.raises(CalibrationError) as caught:
        calibrate([path])
    assert str(path) in str(caught.value) and "runs.0.bundle" in str(caught.value)
    assert "smollm2-q4-k8v4" in str(caught.value)


def test_calibration_without_the_profile(soaked: Soaked, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cal = tmp_path / "calibration.json"
    calibration = calibrate([soaked.results], bundle=soaked.bundle)
    cal.write_text(json.dumps(calibration.model_dump(mode="json", by_alias=True)))
    code, err = _fails(["plan", str(soaked.bundle), "-d", "iPhone14,2", "--calibration", str(cal)], capsys)
    assert code == CalibrationError.exit_code
    assert str(cal) in err and "profiles." in err


def test_an_output_that_cannot_be_written_is_exit_38_and_keeps_the_old_file(
    soaked: Soaked, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """calibration.json is replaced whole or not at all (a folder where it goes, or a file where its folder goes);
    it was written in place, and a failure was a traceback."""
    blocked = tmp_path / "file"
    blocked.write_text("not a folder\n")
    args = ["calibrate", str(soaked.results), "--bundle", str(soaked.bundle)]
    code, err = _fails([*args, "-o", str(blocked / "c.json")], capsys)
    assert code == OutputWriteError.exit_code == 38 and str(blocked / "c.json") in err
    assert blocked.read_text() == "not a folder\n"
    kept = tmp_path / "calibration.json"
    kept.mkdir()
    code, err = _fails([*args, "-o", str(kept)], capsys)
    assert code == 38 and kept.is_dir() and list(tmp_path.glob(".*.tmp")) == []
