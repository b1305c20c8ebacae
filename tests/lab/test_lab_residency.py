"""Issue 27, item 5: the lab runs one bundle with its weights loaded and with them mapped, and reports the
footprint of each at the same context side by side; `kvrig calibrate` fits the same baseline from both.

A real SmolLM2 bundle laid out for mapping, its LLM app built for the virtual iPhone, one lab entry listing
`residencies: [loaded, mapped]`, soaked to 256 tokens in two steps on a phone with room for both. The host cannot map
without a copy, so the mapped run holds the same memory here and reports the phone's residency; the kernel leaves
the mapped bytes out of the footprint (tests/outcomes/test_mapped_residency.py soaks both into jetsam). Expected
numbers come from elsewhere: the weights' bytes from MLX's nbytes, the baseline from the phone's own setting.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest
import yaml

from kvrig.appgen.render import AppOptions, render_app
from kvrig.appgen.virtual_ipa import build_virtual_ipa
from kvrig.calibration import calibrate
from kvrig.device.loop import run_async
from kvrig.lab.predict import Predictor
from kvrig.lab.schedule import run_lab
from kvrig.planner import plan as make_memory_plan
from kvrig.schemas import load_model_file
from kvrig.schemas.lab import load_lab
from kvrig.schemas.results import ResultsFile, SoakResult, short_udid
from tests.bundle_fixtures import MAPPED, MAPPED_NAME, MAPPED_RECIPE, packaged
from tests.html_tables import table_rows
from tests.lab.conftest import MIB, ROOT
from tests.raw_telemetry import raw_steps
from tests.virtual.conftest import emulator_host

PROFILE = "iPhone16,1"
APP_ID = "dev.kvrig.labmapped"
BASELINE = 48 * MIB
# Two steps at the same contexts are the claim, not their length: every token is SmolLM2 prefilled on the host CPU
# (a run from start to end record: 4.7 s to 512 tokens, 2.5 s to 256).
MAX_TOKENS = 256


@dataclass
class Lab:
    out: Path
    bundle: Path
    weight_bytes: int
    udid: str
    lab_file: Path
    runs: dict[str, SoakResult]  # by the residency each asked for


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    bundle = packaged(tmp_path_factory, MAPPED_NAME, MAPPED)
    root = tmp_path_factory.mktemp("lab-residency")
    weights = sum(int(a.nbytes) for f in sorted(bundle.glob("*.safetensors")) for a in mx.load(str(f)).values())
    # Room for the loaded run at twice the soak's context, and its prefill transients: both complete.
    memory = make_memory_plan(bundle, PROFILE, schemes=["fp16"], weights=MAPPED_RECIPE, contexts=[2 * MAX_TOKENS])
    kv = memory.kv_bytes["fp16"][str(2 * MAX_TOKENS)]
    limit = BASELINE + memory.weights_bytes + memory.runtime.buffer_cache_bytes + kv + 64 * MIB
    project = render_app(bundle, root / "project", AppOptions(name="LabMapped", bundle_id=APP_ID)).project
    ipa = build_virtual_ipa(project, root)
    with emulator_host(root, "labmap") as host:
        phone = host.add_device(root / "phone", profile=PROFILE, limit_bytes=limit, baseline_bytes=BASELINE)
        udid = phone.identity.udid
        lab_file = root / "lab.yaml"
        entry = {
            "name": "smol",
            "app_id": APP_ID,
            "ipa": str(ipa),
            "bundle_path": str(bundle),
            "schemes": ["fp16"],
            "residencies": ["loaded", "mapped"],
            "soak": {"step_tokens": MAX_TOKENS // 2, "max_tokens": MAX_TOKENS, "decode_tokens": 1},
        }
        timeouts = {"hang_after_s": 180, "reconnect_s": 1, "report_wait_s": 5, "poll_interval_s": 0.2}
        lab_doc = {
            "schema": 1,
            "name": "residency",
            "devices": [{"udid": udid, "limit_bytes": limit, "baseline_bytes": BASELINE}],
            "matrix": [entry],
            "threshold": {"confirm_runs": 0},
            "timeouts": timeouts,
        }
        lab_file.write_text(yaml.safe_dump(lab_doc, sort_keys=False))
        try:
            results = run_async(run_lab(load_lab(lab_file), root / "out"))
        finally:
            host.run(phone.apps.kill_all())
    runs = {r.weights_residency_requested or "": r for r in results.results.runs}
    yield Lab(root / "out", bundle, weights, udid, lab_file, runs)


def test_the_entry_runs_once_per_residency_and_records_what_ran(lab: Lab) -> None:
    saved = load_model_file(ResultsFile, lab.out / "results.json")
    assert saved.schema_version == 5  # schema 3's residency fields, written by today's kvrig
    assert sorted(r.weights_residency_requested or "" for r in saved.runs) == ["loaded", "mapped"]
    loaded, mapped = lab.runs["loaded"], lab.runs["mapped"]
    for run in (loaded, mapped):
        assert run.outcome == "completed", run.outcome_detail
        assert run.entry == "smol" and run.scheme == "fp16"
        assert (lab.out / run.files.telemetry).is_file()  # type: ignore[operator]
    assert (loaded.weights_residency, loaded.mapped_weight_bytes, loaded.residency_note) == ("loaded", 0, None)
    assert (mapped.weights_residency, mapped.mapped_weight_bytes) == ("mapped", lab.weight_bytes)
    # Each residency has its own folder and run id.
    assert loaded.files.telemetry != mapped.files.telemetry and loaded.run_id != mapped.run_id
    assert "/fp16/mapped/" in mapped.files.telemetry  # type: ignore[operator]


def test_each_residency_is_predicted_as_the_kernel_charges_it(lab: Lab) -> None:
    """The mapped run is planned with its weights out of the footprint: the loaded plan of a phone whose limit is
    larger by MLX's nbytes of the weights (the virtual kernel's rule), not the loaded plan itself."""
    loaded, mapped = lab.runs["loaded"].predicted, lab.runs["mapped"].predicted
    assert loaded is not None and mapped is not None
    doc = load_lab(lab.lab_file)
    entry, scheme, device = doc.matrix[0], doc.matrix[0].schemes[0], doc.devices[0]
    assert device.limit_bytes is not None
    roomier = device.model_copy(update={"limit_bytes": device.limit_bytes + lab.weight_bytes})
    expected = Predictor([]).predict(entry, scheme, PROFILE, roomier, virtual=True, residency="loaded")
    assert expected is not None
    assert mapped.max_context == expected.max_context > loaded.max_context
    # Either footprint is the phone's, against the same limit: the mapped one without the weights.
    assert mapped.limit_bytes == loaded.limit_bytes == device.limit_bytes
    assert mapped.footprint_at_max_context_bytes == expected.footprint_at_max_context_bytes - lab.weight_bytes


def _footprints(run: SoakResult) -> dict[int, int]:
    return {p.context_tokens: p.phys_footprint_bytes for p in run.tps_curve if p.phys_footprint_bytes is not None}


def test_the_footprints_at_the_same_context_differ_by_the_mapped_weights(lab: Lab) -> None:
    loaded, mapped = _footprints(lab.runs["loaded"]), _footprints(lab.runs["mapped"])
    common = sorted(set(loaded) & set(mapped))
    assert len(common) == 2, (loaded, mapped)  # both steps, at the same contexts
    assert all(loaded[c] - mapped[c] == lab.weight_bytes for c in common), (loaded, mapped)


def _side_by_side(report: Path) -> dict[str, str]:
    (row,) = table_rows(report.read_text(), "residency")
    return row


def test_the_report_sets_the_two_footprints_side_by_side(lab: Lab, tmp_path: Path) -> None:
    loaded, mapped = _footprints(lab.runs["loaded"]), _footprints(lab.runs["mapped"])
    context = max(set(loaded) & set(mapped))
    row = _side_by_side(lab.out / "report.html")
    assert row["Device"] == short_udid(lab.udid) and (row["Entry"], row["Scheme"]) == ("smol", "fp16")
    assert row["Context"] == str(context)
    assert row["Footprint loaded"] == f"{loaded[context] / MIB:.1f} MiB"
    assert row["Footprint mapped"] == f"{mapped[context] / MIB:.1f} MiB"
    assert row["Loaded − mapped"] == f"{lab.weight_bytes / MIB:.1f} MiB"
    assert row["Weights ran (loaded / mapped)"] == f"loaded / mapped ({lab.weight_bytes / MIB:.1f} MiB)"
    assert list((lab.out / "report").glob("*-residency.png"))
    # `kvrig lab report` renders the same from results.json alone, anywhere.
    done = subprocess.run(
        [sys.executable, "-m", "kvrig", "lab", "report", str(lab.out / "results.json"), "-o", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert _side_by_side(tmp_path / "report.html") == row
    assert list((tmp_path / "report").glob("*-residency.png"))


def test_calibrate_fits_the_same_baseline_from_either_residency(lab: Lab) -> None:
    calibration = calibrate([lab.out / "results.json"], bundle=lab.bundle)
    (entry,) = calibration.profiles.values()
    by_run: dict[str, list[int]] = {}
    for point in entry.measurements:
        by_run.setdefault(point.run_id, []).append(point.baseline_bytes)
    loaded, mapped = (statistics.median(by_run[lab.runs[r].run_id]) for r in ("loaded", "mapped"))
    assert {p.mapped_weight_bytes for p in entry.measurements if p.run_id == lab.runs["mapped"].run_id} == {
        lab.weight_bytes
    }
    # Counting the mapped weights as footprint would put the mapped run's baseline lower by all of them.
    assert loaded == mapped
    # Both the phone's own baseline, plus what MLX holds between steps beyond the planner's weights and the KV
    # (the last logits, generate_step's arrays), taken from the app's own telemetry as tests/test_calibrate.py does.
    weights = entry.measurements[0].weights_bytes
    steps = raw_steps(lab.out / lab.runs["loaded"].files.telemetry)  # type: ignore[operator]
    extra = statistics.median(s["mlx_active_bytes"] - s["kv_bytes"] - weights for s in steps)
    assert abs(extra) < 4 * MIB
    assert abs(loaded - (BASELINE + extra)) <= entry.spread_bytes + 16384
