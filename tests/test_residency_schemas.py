"""The files that carry the weights' residency (issue 27): soak plan schema 3, results schema 3, calibration
schema 2, each reading its older files and refusing an older file that carries a newer field; and the lab's
side-by-side of a loaded and a mapped run, including one that fell back to loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvrig.lab.report import residency_pairs, write_report
from kvrig.schemas.calibration import Calibration
from kvrig.schemas.results import DeviceRef, ResultsFile, SoakResult, TpsPoint
from kvrig.schemas.soakplan import SoakPlan
from kvrig.soaking.plan import make_plan
from tests.html_tables import table_rows

MIB = 1024 * 1024


def test_soak_plan_3_names_the_residency_and_plan_2_still_reads() -> None:
    plan = make_plan(max_tokens=512, weights_residency="mapped")
    data = json.loads(plan.model_dump_json(by_alias=True))
    assert (data["schema"], data["weights_residency"]) == (4, "mapped")
    assert make_plan(max_tokens=512).weights_residency is None  # as the bundle says
    older = {**data, "schema": 2}
    older.pop("weights_residency")
    assert SoakPlan.model_validate(older).schema_version == 2
    with pytest.raises(ValidationError, match="schema-3 field"):
        SoakPlan.model_validate({**older, "weights_residency": "loaded"})
    with pytest.raises(ValidationError):
        SoakPlan.model_validate({**data, "weights_residency": "wired"})
    assert SoakPlan.model_validate({**data, "schema": 3}).schema_version == 3


def test_soak_plan_4_names_the_buffer_cache_and_plan_3_still_reads() -> None:
    data = json.loads(make_plan(max_tokens=512, buffer_cache="uncapped").model_dump_json(by_alias=True))
    assert (data["schema"], data["buffer_cache"]) == (4, "uncapped")
    assert make_plan(max_tokens=512).buffer_cache is None  # capped, as kvcache.json says
    older = {**data, "schema": 3, "buffer_cache": None}
    assert SoakPlan.model_validate(older).schema_version == 3
    with pytest.raises(ValidationError, match="schema-4 field"):
        SoakPlan.model_validate({**older, "buffer_cache": "uncapped"})
    with pytest.raises(ValidationError):
        SoakPlan.model_validate({**data, "buffer_cache": "unbounded"})


def _run(residency: str | None, *, ran: str | None = None, footprints: dict[int, int] | None = None) -> SoakResult:
    return SoakResult(
        run_id=f"r-{residency}",
        device=DeviceRef(udid="UDID-1", profile="iphone-15-pro"),
        app_id="dev.kvrig.soak",
        entry="smol",
        scheme="k8v4",
        weights_residency_requested=residency,  # type: ignore[arg-type]
        weights_residency=ran,  # type: ignore[arg-type]
        outcome="completed",
        tps_curve=[TpsPoint(context_tokens=c, phys_footprint_bytes=b) for c, b in (footprints or {}).items()],
    )


def test_results_3_record_the_residency_and_2_still_reads() -> None:
    old = {"schema": 2, "tool_version": "0", "runs": [_run(None).model_dump(mode="json", exclude_none=True)]}
    assert ResultsFile.model_validate(old).runs[0].weights_residency is None
    carrying = json.loads(json.dumps(old))
    carrying["runs"][0]["weights_residency"] = "mapped"
    with pytest.raises(ValidationError, match=r"runs\.0: .*schema-3 fields"):
        ResultsFile.model_validate(carrying)
    assert ResultsFile.model_validate({**carrying, "schema": 3}).runs[0].weights_residency == "mapped"
    assert _run("mapped").variant == "k8v4/mapped" and _run(None).variant == "k8v4"


def test_calibration_2_records_mapped_bytes_and_1_still_reads() -> None:
    point = {
        "source": "r.json",
        "run_id": "r",
        "scheme": "k8v4",
        "context_tokens": 512,
        "footprint_bytes": 10,
        "weights_bytes": 5,
        "kv_bytes": 1,
        "buffer_cache_bytes": 0,
        "overhead_bytes": 4,
        "baseline_bytes": 4,
    }
    profile = {
        "baseline_bytes": 4,
        "points": 1,
        "spread_bytes": 0,
        "min_baseline_bytes": 4,
        "max_baseline_bytes": 4,
        "profile_baseline_bytes": 9,
        "sources": ["r.json"],
        "measurements": [point],
    }
    old = {"schema": 1, "tool_version": "0", "profiles": {"p": profile}}
    assert Calibration.model_validate(old).profiles["p"].measurements[0].mapped_weight_bytes == 0
    profile["measurements"] = [{**point, "mapped_weight_bytes": 5}]
    with pytest.raises(ValidationError, match="schema-2 field"):
        Calibration.model_validate(old)
    assert Calibration.model_validate({**old, "schema": 2}).profiles["p"].measurements[0].mapped_weight_bytes == 5


def test_the_report_pairs_runs_by_the_residency_they_asked_for(tmp_path: Path) -> None:
    loaded = _run("loaded", ran="loaded", footprints={256: 300 * MIB, 512: 310 * MIB, 768: 320 * MIB})
    mapped = _run("mapped", ran="mapped", footprints={256: 200 * MIB, 512: 210 * MIB, 768: 220 * MIB, 1024: 230 * MIB})
    mapped.mapped_weight_bytes = 100 * MIB
    fell_back = _run("mapped", ran="loaded", footprints={256: 300 * MIB})
    fell_back.residency_note = "model.safetensors: tensor 'x' starts at byte 8, not on a 16384-byte page"
    fell_back.device = DeviceRef(udid="UDID-2", profile="iphone-13-pro")
    lone = _run(None, ran="loaded", footprints={256: 1})  # no pair: not in the table
    results = ResultsFile(tool_version="0", runs=[loaded, mapped, fell_back, lone])
    assert [(p.loaded.run_id, p.mapped.run_id) for p in residency_pairs(results)] == [("r-loaded", "r-mapped")]
    (row,) = table_rows(write_report(results, tmp_path).read_text(), "residency")
    # The largest context both reached, the two footprints, the difference.
    assert (row["Context"], row["Footprint loaded"], row["Footprint mapped"]) == ("768", "320.0 MiB", "220.0 MiB")
    assert row["Loaded − mapped"] == "100.0 MiB"
    assert row["Weights ran (loaded / mapped)"] == "loaded / mapped (100.0 MiB)"
    # A run that asked for mapped and loaded says why, in the main table.
    text = (tmp_path / "report.html").read_text()
    assert "loaded: model.safetensors: tensor &#39;x&#39; starts at byte 8" in text
    assert list((tmp_path / "report").glob("*-residency.png"))
