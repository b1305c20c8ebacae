"""The limits registry: collected from results (schema 4) per ProductType × OS build × entitlement, merged into
a team's file, read back strictly, exported as JSON Schema, and used by the lab's predictions.

The runs here are written by hand, so every expected number is the one the test wrote into them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from kvrig.calibration import collect_limits
from kvrig.cli import cli
from kvrig.exceptions import SchemaError
from kvrig.lab.predict import Predictor
from kvrig.planner.limits import load_limits
from kvrig.schemas import validate_data
from kvrig.schemas.lab import LabDevice, MatrixEntry
from kvrig.schemas.results import DeviceRef, ResultsFile
from tests.cli_run import run

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "testapp-model" / "config.json"
MIB = 1 << 20


def _run(run_id: str, started: float, limit_mb: int, *, build: str = "23A341", entitled: bool | None = True) -> dict:
    return {
        "run_id": run_id,
        "device": {"udid": "00008130-0001", "product_type": "iPhone16,1", "build_version": build},
        "app_id": "dev.kvrig.demo",
        "scheme": "k8v4",
        "outcome": "jetsam",
        "started": started,
        "stated_limit": {
            "product_type": "iPhone16,1",
            "os_version": "26.0",
            "build_version": build,
            "entitled": entitled,
            "active_bytes": limit_mb * MIB,
            "inactive_bytes": limit_mb * MIB,
            "lines": [f"[KVSoak:812] Memory Limits: active {limit_mb} inactive {limit_mb}"],
        },
    }


def _results(path: Path, *runs: dict, schema: int = 5) -> Path:
    path.write_text(json.dumps({"schema": schema, "tool_version": "test", "runs": list(runs)}))
    return path


def test_runs_of_one_phone_build_and_entitlement_make_one_entry(tmp_path: Path) -> None:
    first = _results(tmp_path / "a.json", _run("r1", 100.0, 3072), _run("r2", 300.0, 3000))
    second = _results(tmp_path / "b.json", _run("r3", 200.0, 3072), _run("r4", 50.0, 2048, build="23B85"))
    got = collect_limits([first, second])
    assert got.added == 4 and got.skipped == []
    by_build = {e.build_version: e for e in got.registry.limits}
    entry = by_build["23A341"]
    assert entry.runs == 3 and entry.limit_bytes == 3000 * MIB  # the latest run's (started 300)
    assert entry.seen_bytes == [3000 * MIB, 3072 * MIB]  # the runs disagree: both kept
    assert entry.sources == [f"{first}#r1", f"{first}#r2", f"{second}#r3"]
    assert by_build["23B85"].limit_bytes == 2048 * MIB  # another build, its own entry

    again = collect_limits([first], got.registry)  # calibrating the same file twice counts each run once
    assert again.added == 0 and again.registry.limits == got.registry.limits


def test_a_run_whose_entitlement_is_unknown_is_skipped_with_why(tmp_path: Path) -> None:
    path = _results(tmp_path / "a.json", _run("r1", 1.0, 3072, entitled=None))
    got = collect_limits([path])
    assert got.registry.limits == []
    assert got.skipped == [f"{path}#r1: runs.0.stated_limit has no entitled"]


def test_a_virtual_iphones_limit_is_no_phones_fact(tmp_path: Path) -> None:
    """The demo soaks a virtual iPhone 15 Pro with the limit it was started with: calibrating from it put that
    limit in the registry as the phone's, and `plan --limits` planned real iPhone 15 Pros against it."""
    virtual = _run("r1", 1.0, 160)
    virtual["device"]["virtual"] = True
    path = _results(tmp_path / "a.json", virtual, _run("r2", 2.0, 3072), schema=4)
    data = json.loads(path.read_text())
    with pytest.raises(SchemaError, match=r"device\.virtual is schema 5's"):  # a schema-4 file cannot say it
        validate_data(ResultsFile, data)
    path.write_text(json.dumps({**data, "schema": 5}))
    got = collect_limits([path])
    assert got.added == 1 and [e.limit_bytes for e in got.registry.limits] == [3072 * MIB]
    assert got.skipped == [f"{path}#r1: a virtual iPhone's limit, not a phone's (--include-virtual keeps it)"]
    kept = collect_limits([path], include_virtual=True)  # trying the registry out on virtual phones
    assert kept.added == 2 and kept.skipped == []
    (entry,) = kept.registry.limits
    assert entry.sources == [f"{path}#r1", f"{path}#r2"] and entry.virtual_sources == [f"{path}#r1"]


def test_a_plan_against_a_virtual_iphones_limit_says_so(tmp_path: Path) -> None:
    """Kept with --include-virtual, the entry carries where it came from into the plan's line and the devices table;
    a registry of phones only is written without the field, as older kvrig wrote (and reads) it."""
    virtual = _run("r1", 1.0, 160)
    virtual["device"]["virtual"] = True
    results = _results(tmp_path / "a.json", virtual)
    runner = CliRunner()
    phones_only = tmp_path / "phones.json"
    args = ["calibrate", str(_results(tmp_path / "b.json", _run("r2", 2.0, 3072))), "--limits-only"]
    assert runner.invoke(cli, [*args, "--limits", str(phones_only)]).exit_code == 0
    assert "virtual_sources" not in phones_only.read_text()
    out = tmp_path / "limits.json"
    args = ["calibrate", str(results), "--limits", str(out), "--limits-only", "--include-virtual"]
    assert runner.invoke(cli, args).exit_code == 0
    assert json.loads(out.read_text())["limits"][0]["virtual_sources"] == [f"{results}#r1"]
    plan = ["plan", "-d", "iPhone16,1", "--limits", str(out), "--kv", "fp16", "--json"]
    planned = runner.invoke(cli, plan)
    assert planned.exit_code == 0, planned.output
    said = json.loads(planned.output)["limit_measured_from"]
    assert "1 of 1 from a virtual iPhone" in said
    phones = runner.invoke(cli, [*plan[:-1], "--limits", str(phones_only), "--json"])
    assert "from a virtual iPhone" not in json.loads(phones.output)["limit_measured_from"]


def test_a_file_that_cannot_say_whether_the_phone_was_virtual_is_kept_out(tmp_path: Path) -> None:
    """Results before schema 5 have no device.virtual: a virtual iPhone's run there read as a real phone's, and its
    limit went into the registry. Such runs are kept only when asked (--include-virtual)."""
    path = _results(tmp_path / "a.json", _run("r1", 1.0, 160), schema=4)
    got = collect_limits([path])
    assert got.added == 0 and got.registry.limits == []
    assert got.skipped == [
        f"{path}#r1: results schema 4 does not say whether the phone was kvrig's virtual iPhone, whose limit is "
        "whatever it was started with (--include-virtual keeps it)"
    ]
    assert collect_limits([path], include_virtual=True).added == 1


def test_the_registry_is_read_strictly_and_exported_as_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "limits.json"
    runner = CliRunner()
    results = _results(tmp_path / "a.json", _run("r1", 1.0, 3072))
    done = runner.invoke(cli, ["calibrate", str(results), "--limits", str(out), "--limits-only"])
    assert done.exit_code == 0, done.output
    assert "iPhone16,1" in done.output and "23A341" in done.output
    planned = runner.invoke(cli, ["plan", "-d", "iPhone16,1", "--limits", str(out), "--os-build", "23A341"])
    # whose each limit is: the profile's two, and the one the phone stated that the plan takes
    assert (
        "App memory limit: the profile's: default 3.3 GiB, entitled 6.0 GiB; planning against the stated "
        in (planned.output)
        and "entitled 3.0 GiB" in planned.output
    ), planned.output
    data = json.loads(out.read_text())
    schema = json.loads(runner.invoke(cli, ["profiles", "schema", "--limits"]).output)
    jsonschema.validate(data, schema)

    data["limits"].append(dict(data["limits"][0]))  # the same ProductType × build × entitlement twice
    out.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match="listed twice") as twice:
        load_limits(out)
    assert str(out) in str(twice.value)
    data["limits"] = [{**data["limits"][0], "limit_mb": 3}]
    out.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=r"limits\.0\.limit_mb"):
        load_limits(out)
    refused = runner.invoke(cli, ["plan", "--device", "iPhone16,1", "--limits", str(out)]).exception
    assert isinstance(refused, SchemaError) and refused.exit_code == 3  # the CLI's exit for it


def test_schema_4_fields_are_refused_in_an_older_results_file() -> None:
    run = _run("r1", 1.0, 3072)
    with pytest.raises(SchemaError, match="schema 4"):
        validate_data(ResultsFile, {"schema": 3, "tool_version": "t", "runs": [run]})
    bare = {k: v for k, v in run.items() if k != "stated_limit"}
    bare["device"] = {"udid": "u"}
    with pytest.raises(SchemaError, match="vanished"):
        validate_data(ResultsFile, {"schema": 3, "tool_version": "t", "runs": [{**bare, "outcome": "vanished"}]})
    old = validate_data(ResultsFile, {"schema": 3, "tool_version": "t", "runs": [{**bare, "outcome": "crash"}]})
    assert old.runs[0].outcome == "crash"  # what schema 3 called any death without an end record still reads


def test_the_lab_predicts_against_the_limit_the_phone_build_stated(tmp_path: Path) -> None:
    registry = tmp_path / "limits.json"
    limits = collect_limits([_results(tmp_path / "a.json", _run("r1", 1.0, 200, entitled=False))]).registry
    registry.write_text(limits.model_dump_json(by_alias=True))
    entry = MatrixEntry.model_validate({"app_id": "com.example.app", "model": str(MODEL), "schemes": ["fp16"]})
    device = LabDevice(udid="any", baseline_bytes=48 * MIB)  # the lab file states no limit for it
    notes: list[str] = []
    predictor = Predictor(notes, limits=registry)
    phone = DeviceRef(udid="u", product_type="iPhone16,1", build_version="23A341")
    measured = predictor.predict(entry, entry.schemes[0], "iphone-15-pro", device, phone=phone)
    assert measured is not None and measured.limit_bytes == 200 * MIB  # the lab plans the default limit
    assert measured.limit_source is not None and measured.limit_source.startswith(f"measured: {registry}")
    assert any("23A341" in note for note in notes)

    elsewhere = phone.model_copy(update={"build_version": "23B85"})  # a build the registry has not seen
    profile = predictor.predict(entry, entry.schemes[0], "iphone-15-pro", device, phone=elsewhere)
    assert profile is not None and profile.limit_bytes != 200 * MIB
    assert profile.limit_source is not None and profile.limit_source.startswith("iphone-15-pro's default limit")


def test_a_stated_limit_above_the_phones_ram_is_refused_naming_the_file_and_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A registry entry bigger than the phone (hand-edited, or calibrated from a report of another device) would
    plan contexts no phone can hold: `kvrig plan --limits` refuses it (exit 3), as a profile with such a limit is."""
    registry = tmp_path / "limits.json"
    limits = collect_limits([_results(tmp_path / "a.json", _run("r1", 1.0, 9 * 1024))]).registry  # 9 GiB on 8 GB
    registry.write_text(limits.model_dump_json(by_alias=True))
    args = ["plan", "--device", "iPhone16,1", "--limits", str(registry), "--os-build", "23A341", "--contexts", "256"]
    code, out, err = run(capsys, *args)
    assert code == 3, err
    assert str(registry) in err and "iPhone16,1 build 23A341" in err and out == ""
    assert "limit_bytes 9663676416 is more than the phone's RAM (expected at most 8589934592" in err
