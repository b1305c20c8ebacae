"""The lab end to end on two virtual iPhones: a 2-entry matrix with threshold confirmation and predictions,
results.json / junit.xml / report.html, a gate that cannot pass, a lab with no usable phone, and a phone
unplugged mid-lab while the other one carries on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrig.device import apps
from kvrig.device.discovery import list_devices
from kvrig.device.hosts import UsbmuxHost, list_devices_on
from kvrig.device.loop import run_async
from kvrig.lab.model import RUNS_DIR, LabResults
from kvrig.lab.schedule import Scheduler, run_lab
from kvrig.lab.targets import select_targets
from kvrig.profiles import INCREASED_MEMORY_LIMIT, load_profile
from kvrig.schemas import load_model_file
from kvrig.schemas.lab import Lab, load_lab, slug
from kvrig.schemas.results import ResultsFile, SoakResult
from tests.device.conftest import make_ipa, on_device, run
from tests.lab.conftest import BUNDLE_ID, FAST, MIB, ROOT, Phones, phones, short_entry
from tests.lab.test_lab_predict import reference_plan
from tests.raw_telemetry import raw_steps

__all__ = ["phones"]
MODEL = ROOT / "examples" / "testapp-model" / "config.json"


def write_lab(path: Path, lab: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump({"schema": 1, "timeouts": FAST, **lab}, sort_keys=False))
    return path


def by_key(runs: list[SoakResult]) -> dict[tuple[str, str, str], SoakResult]:
    return {(r.device.udid, r.entry or "", r.scheme): r for r in runs}


def cli(phones: Phones, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=phones.address)
    return subprocess.run(
        [sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=180
    )


# --- one lab, many checks -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def matrix_lab(phones: Phones, tmp_path_factory: pytest.TempPathFactory) -> tuple[LabResults, Path]:
    root = tmp_path_factory.mktemp("lab")
    lab_file = write_lab(
        root / "lab.yaml",
        {
            "name": "ci",
            "devices": [
                # by profile, with the small limit and the emulator's baseline for the planner
                {"udid": "any", "profile": "iphone-15-pro", "limit_bytes": 160 * MIB, "baseline_bytes": 48 * MIB},
                {"udid": phones.pro13.identity.udid, "profile": "iPhone14,2"},  # by UDID, profile as ProductType
            ],
            "matrix": [
                {
                    "name": "grow",
                    "app_id": BUNDLE_ID,
                    "ipa": str(phones.ipa),
                    "model": str(MODEL),
                    "schemes": ["fp16"],
                    "soak": {"step_tokens": 512, "max_tokens": 1_000_000, "decode_tokens": 1},
                },
                short_entry(schemes=["fp16", {"name": "fp16-kv4", "arguments": ["--kv-heads", "4"]}]),
            ],
            "gates": {"min_max_safe_context": 512, "min_decode_tps_at": {256: 0.001}},
            "threshold": {"confirm_runs": 1, "max_attempts": 2},
        },
    )
    out = root / "out"
    results = run_async(run_lab(load_lab(lab_file), out))
    return results, out


def test_results_json_validates_and_holds_every_run(matrix_lab: tuple[LabResults, Path], phones: Phones) -> None:
    results, out = matrix_lab
    saved = load_model_file(ResultsFile, out / "results.json")
    assert saved.runs == results.results.runs
    runs = by_key(saved.runs)
    udids = (phones.pro15.identity.udid, phones.pro13.identity.udid)
    assert set(runs) == {
        (u, e, s) for u in udids for e, s in (("grow", "fp16"), ("short", "fp16"), ("short", "fp16-kv4"))
    }
    for udid in udids:
        assert runs[udid, "grow", "fp16"].outcome == "jetsam"
        assert runs[udid, "short", "fp16"].outcome == "completed"
        assert runs[udid, "short", "fp16-kv4"].outcome == "completed"
    assert runs[udids[0], "grow", "fp16"].device.profile == "iphone-15-pro"
    assert runs[udids[1], "grow", "fp16"].device.profile == "iphone-13-pro"
    assert results.passed and not results.failed
    # every kind of end counted apart, confirmation runs included; each phone stated the limit it was given
    ends = Counter(o for r in saved.runs for o in (r.outcome, *(c.outcome for c in r.confirmations)))
    assert saved.lab is not None and saved.lab.outcomes == dict(ends) and ends["jetsam"] >= 2
    for phone, udid in ((phones.pro15, udids[0]), (phones.pro13, udids[1])):
        stated = runs[udid, "grow", "fp16"].stated_limit
        assert stated is not None and stated.active_bytes == phone.identity.limit_bytes
    # the scheme's launch arguments reached the app: half the KV heads, half the KV bytes at the same context
    tel = {s: raw_steps(out / runs[udids[0], "short", s].files.telemetry) for s in ("fp16", "fp16-kv4")}
    assert tel["fp16-kv4"][-1]["kv_bytes"] * 2 == tel["fp16"][-1]["kv_bytes"]


def test_threshold_search_confirms_the_last_context_that_survived(
    matrix_lab: tuple[LabResults, Path], phones: Phones
) -> None:
    results, out = matrix_lab
    for device in (phones.pro15, phones.pro13):
        grow = by_key(results.results.runs)[device.identity.udid, "grow", "fp16"]
        main_steps = raw_steps(out / grow.files.telemetry)
        (report,) = grow.files.jetsam_reports
        assert (out / report).exists()
        last_survived = main_steps[-1]["context_tokens"]
        assert grow.max_safe_context == last_survived and grow.max_safe_context_confirmed
        (confirm,) = grow.confirmations
        assert confirm.outcome == "completed" and confirm.max_tokens == last_survived
        # the repeat run really grew to that context and ended on its own
        confirm_tel = out / confirm.folder / "telemetry.jsonl"
        records = [json.loads(x) for x in confirm_tel.read_text().splitlines() if x.strip()]
        assert records[-1]["event"] == "end" and records[-1]["reason"] == "completed"
        assert raw_steps(confirm_tel)[-1]["context_tokens"] == last_survived
        assert not list((out / confirm.folder).glob("reports/JetsamEvent-*.ips"))
        # the smaller limit holds less
    runs = by_key(results.results.runs)
    assert (
        runs[phones.pro13.identity.udid, "grow", "fp16"].max_safe_context
        < runs[phones.pro15.identity.udid, "grow", "fp16"].max_safe_context
    )
    # runs that completed were not searched
    short = runs[phones.pro15.identity.udid, "short", "fp16"]
    assert short.confirmations == [] and not short.max_safe_context_confirmed and short.max_safe_context == 512


def test_predictions_use_the_lab_limit_or_the_profile(matrix_lab: tuple[LabResults, Path], phones: Phones) -> None:
    results, _ = matrix_lab
    runs = by_key(results.results.runs)
    pro15 = runs[phones.pro15.identity.udid, "grow", "fp16"].predicted
    assert pro15 is not None and pro15.limit_bytes == 160 * MIB and pro15.max_context
    # both phones here are virtual (lockdownd says so): planned on the CPU their app runs on, not on Metal
    virtual = {d.udid: d.virtual for d in run_async(list_devices(usbmux_address=phones.address))}
    assert virtual[phones.pro15.identity.udid] and virtual[phones.pro13.identity.udid]
    assert pro15.max_context == reference_plan("cpu") != reference_plan("metal")
    profile = yaml.safe_load((ROOT / "device_profiles" / "iphone-13-pro.yaml").read_text())
    pro13 = runs[phones.pro13.identity.udid, "grow", "fp16"].predicted
    assert pro13 is not None and pro13.limit_bytes == profile["app_memory_limit"]["default_bytes"]["value"]
    assert pro13.limit_source is not None and f"{BUNDLE_ID} does not declare" in pro13.limit_source
    # entries without a model get no prediction
    assert runs[phones.pro15.identity.udid, "short", "fp16"].predicted is None


def test_the_lab_predicts_the_limit_each_app_gets_from_its_ipa_or_the_phones_listing(
    phones: Phones, tmp_path: Path
) -> None:
    """plan.limit: app (the default): the .ipa the lab installs says whether the app declares increased-memory-limit,
    else the phone's installation_proxy listing of the installed app."""
    entitlements = {INCREASED_MEMORY_LIMIT: True}
    to_install = make_ipa(tmp_path / "e.ipa", "dev.kvrig.entitled", "KVEntitled", entitlements=entitlements)
    installed = make_ipa(tmp_path / "l.ipa", "dev.kvrig.listed", "KVListed", entitlements=entitlements)
    udid = phones.pro15.identity.udid
    run(on_device(udid, lambda d: apps.install(d, installed)))  # there before the lab, which installs no .ipa of it
    entry = {"model": str(MODEL), "schemes": ["fp16"]}
    lab = Lab.model_validate(
        {
            "schema": 1,
            "devices": [{"udid": udid, "baseline_bytes": 48 * MIB}],  # no limit_bytes: the profile's limits
            "matrix": [
                {"name": "from-ipa", "app_id": "dev.kvrig.entitled", "ipa": str(to_install), **entry},
                {"name": "listed", "app_id": "dev.kvrig.listed", **entry},
                {"name": "plain", "app_id": BUNDLE_ID, "ipa": str(phones.ipa), **entry},
                {"name": "forced", "app_id": BUNDLE_ID, "plan": {"limit": "entitled"}, **entry},
            ],
        }
    )
    hosts = [UsbmuxHost("lab", phones.address)]
    scheduler = Scheduler(lab, tmp_path / "out", None, hosts)
    attached, _ = run_async(list_devices_on(hosts))
    planned = run_async(scheduler.plan_runs(select_targets(lab, attached)))
    predicted = {r.entry.label: r.result.predicted for r in planned[udid]}
    profile = load_profile("iPhone16,1")
    assert profile.limit_entitled is not None
    for name, limit, why in (
        ("from-ipa", profile.limit_entitled, "dev.kvrig.entitled declares"),
        ("listed", profile.limit_entitled, "dev.kvrig.listed declares"),
        ("plain", profile.limit_default, f"{BUNDLE_ID} does not declare"),
        ("forced", profile.limit_entitled, "plan.limit: entitled"),
    ):
        got = predicted[name]
        assert got is not None and got.limit_bytes == limit and why in (got.limit_source or ""), (name, got)


def test_junit_xml_one_suite_per_device_one_case_per_entry_and_scheme(
    matrix_lab: tuple[LabResults, Path], phones: Phones
) -> None:
    results, out = matrix_lab
    root = ET.parse(out / "junit.xml").getroot()
    assert root.tag == "testsuites" and root.get("tests") == "6" and root.get("failures") == "0"
    suites = root.findall("testsuite")
    assert len(suites) == 2
    saved = by_key(results.results.runs)
    for suite in suites:
        udid = suite.find("properties/property[@name='udid']").get("value")
        cases = suite.findall("testcase")
        # each case names its run, the phone and the host the phone is on
        host = suite.find("properties/property[@name='host']").get("value")
        assert sorted(c.get("name") for c in cases) == [
            f"{run} on {udid} @ {host}" for run in ("grow[fp16]", "short[fp16-kv4]", "short[fp16]")
        ]
        assert not suite.findall(".//failure") and not suite.findall(".//error") and not suite.findall(".//skipped")
        for case in cases:
            entry, scheme = case.get("name").split(" on ")[0][:-1].split("[")
            props = {p.get("name"): p.get("value") for p in case.findall("properties/property")}
            assert props["udid"] == udid and props["host"] == host
            r = saved[udid, entry, scheme]
            assert props["outcome"] == r.outcome
            assert int(props["max_safe_context"]) == r.max_safe_context
            assert props["gate.min_max_safe_context"] == "passed"


def test_report_html_references_pngs_that_exist(matrix_lab: tuple[LabResults, Path], tmp_path: Path) -> None:
    results, out = matrix_lab
    html = (out / "report.html").read_text()
    images = re.findall(r'<img src="([^"]+)"', html)
    # footprint and tok/s for each of the 6 runs, and a thermal plot for each run whose phone reported its battery
    runs = results.results.runs
    with_battery = [r for r in runs if any(b.temperature_c is not None for b in r.battery)]
    assert with_battery, "the virtual phones report battery samples; the thermal plot is then part of the report"
    assert len(images) == 2 * len(runs) + len(with_battery)
    assert sum(src.endswith("-thermal.png") for src in images) == len(with_battery)
    for src in images:
        assert (out / src).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # `kvrig lab report` renders the same from results.json alone, elsewhere
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "lab", "report", str(out / "results.json"), "-o", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    again = re.findall(r'<img src="([^"]+)"', (tmp_path / "report.html").read_text())
    assert sorted(again) == sorted(images) and all((tmp_path / src).exists() for src in again)
    said = json.loads(proc.stdout)
    assert said["report"] == str(tmp_path / "report.html") and set(again) <= set(said["files"])


# --- gates and exit codes -----------------------------------------------------------------------------------


def test_impossible_gate_is_a_failure_with_its_own_exit_code(phones: Phones, tmp_path: Path) -> None:
    lab_file = write_lab(
        tmp_path / "lab.yaml",
        {
            "devices": [{"udid": phones.pro15.identity.udid}],
            "matrix": [{"app_id": BUNDLE_ID, "schemes": ["fp16"], "soak": {"step_tokens": 256, "max_tokens": 512}}],
            "gates": {"min_max_safe_context": 1_000_000_000, "min_decode_tps_at": {256: 0.001}},
        },
    )
    proc = cli(phones, "lab", "run", str(lab_file), "-o", str(tmp_path / "out"))
    assert proc.returncode == 17, proc.stderr
    assert "Traceback" not in proc.stderr and "failed" in proc.stderr
    (case,) = ET.parse(tmp_path / "out" / "junit.xml").getroot().iter("testcase")
    (failure,) = case.findall("failure")
    assert failure.get("type") == "gate" and "min_max_safe_context" in failure.get("message")
    (run,) = load_model_file(ResultsFile, tmp_path / "out" / "results.json").runs
    assert run.outcome == "completed"
    status = {g.gate: g.status for g in run.gates}
    assert status == {"min_max_safe_context": "failed", "min_decode_tps_at[256]": "passed"}


def test_lab_that_cannot_run_has_another_exit_code(phones: Phones, tmp_path: Path) -> None:
    lab_file = write_lab(
        tmp_path / "lab.yaml",
        {
            "devices": [
                {"udid": "00000000-NOTATTACHED"},
                {"udid": phones.pro15.identity.udid, "profile": "iphone-13-pro"},  # it is a 15 Pro
            ],
            "matrix": [{"app_id": BUNDLE_ID, "schemes": ["fp16"], "soak": {"max_tokens": 512}}],
        },
    )
    proc = cli(phones, "lab", "run", str(lab_file), "-o", str(tmp_path / "out"), "--json")
    assert proc.returncode == 18, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = {r.device.udid: r.error for r in load_model_file(ResultsFile, tmp_path / "out" / "results.json").runs}
    assert "is not attached" in errors["00000000-NOTATTACHED"]
    assert "expected profile iphone-13-pro" in errors[phones.pro15.identity.udid]
    assert len(list(ET.parse(tmp_path / "out" / "junit.xml").getroot().iter("error"))) == 2


# --- a phone unplugged mid-lab ------------------------------------------------------------------------------


@pytest.fixture()
def replugged(phones: Phones) -> Iterator[Phones]:
    yield phones
    phones.host.run(phones.pro13.replug())
    for device in (phones.pro15, phones.pro13):
        phones.host.run(device.apps.kill_all())


def test_unplugged_phone_is_device_lost_while_the_other_completes(replugged: Phones, tmp_path: Path) -> None:
    phones = replugged
    lab_file = write_lab(
        tmp_path / "lab.yaml",
        {
            "devices": [{"udid": "any"}],
            "matrix": [
                {
                    "name": "grow",
                    "app_id": BUNDLE_ID,
                    "schemes": ["fp16", {"name": "fp16-kv4", "arguments": ["--kv-heads", "4"]}],
                    "soak": {"step_tokens": 256, "max_tokens": 1_000_000, "decode_tokens": 1},
                }
            ],
            "threshold": {"confirm_runs": 0},
        },
    )
    out = tmp_path / "out"
    phones.telemetry(phones.pro13).unlink(missing_ok=True)
    snapshot: dict[str, bytes] = {}

    def pulled_steps() -> int:
        """Steps the lab has pulled from the phone (its local copies), not the steps the app wrote: the app can
        write two between two polls, and then nothing was pulled before the loss."""
        copies = (out / RUNS_DIR / slug(phones.pro13.identity.udid)).rglob("telemetry.jsonl")
        return sum(path.read_text().count('"event":"step"') for path in copies)

    def pull_the_cable_after_two_steps() -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if pulled_steps() >= 2:
                snapshot["junit"] = (out / "junit.xml").read_bytes()  # what a lab that died here would leave
                snapshot["results"] = (out / "results.json").read_bytes()
                phones.host.run(phones.pro13.unplug())
                return
            time.sleep(0.05)

    cable = threading.Thread(target=pull_the_cable_after_two_steps)
    cable.start()
    results = run_async(run_lab(load_lab(lab_file), out))
    cable.join()

    runs = by_key(load_model_file(ResultsFile, out / "results.json").runs)
    lost = phones.pro13.identity.udid
    first, second = runs[lost, "grow", "fp16"], runs[lost, "grow", "fp16-kv4"]
    assert first.outcome == "device_lost" and first.max_context_reached is not None
    assert second.outcome == "device_lost" and "not run" in (second.outcome_detail or "")
    for scheme in ("fp16", "fp16-kv4"):
        assert runs[phones.pro15.identity.udid, "grow", scheme].outcome == "jetsam"
    assert {r.result.device.udid for r in results.failed} == {lost}

    suites = {
        s.find("properties/property[@name='udid']").get("value"): s
        for s in ET.parse(out / "junit.xml").getroot().findall("testsuite")
    }
    assert suites[lost].get("failures") == "2"
    assert {f.get("type") for f in suites[lost].iter("failure")} == {"device_lost"}
    assert suites[phones.pro15.identity.udid].get("failures") == "0"

    # mid-lab, the files already said what was done and what was still to do
    partial = ET.fromstring(snapshot["junit"])
    pending = [
        c.get("name").split(" on ")[0]
        for s in partial.findall("testsuite")
        for c in s.findall("testcase")
        if c.find("error[@type='not-run']") is not None
    ]
    assert "grow[fp16-kv4]" in pending
    assert ResultsFile.model_validate_json(snapshot["results"]).runs
