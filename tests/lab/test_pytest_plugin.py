"""The pytest plugin, registered through its `pytest11` entry point: `pytest --kvrig-lab LAB.yaml` on two virtual
iPhones runs a team's own checks once per phone (markers narrow them), deploys and soaks through the fixtures,
and reports through pytest's own --junitxml with the phone on every case."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import entry_points
from pathlib import Path

import yaml

from tests.lab.conftest import FAST, Phones, phones, short_entry
from tests.virtual.conftest import make_ipa

__all__ = ["phones"]

CHECKS = """
import pytest


def test_every_phone_is_known(kvrig_phone):
    assert kvrig_phone.udid and kvrig_phone.host and kvrig_phone.profile


@pytest.mark.kvrig_phone(profile="iphone-15-pro")
@pytest.mark.kvrig_case(entry="short")
def test_short_soak_completes(kvrig_soak):
    assert kvrig_soak.outcome == "completed"
    assert kvrig_soak.max_safe_context == 512
    assert {g.gate: g.status for g in kvrig_soak.gates} == {"min_max_safe_context": "passed"}


@pytest.mark.kvrig_phone(profile="iphone-13-pro")
def test_bundle_is_deployed(kvrig_bundle):
    assert kvrig_bundle.app_id == "dev.kvrig.soak"
"""


def _pytest_lab(folder: Path, junit: str) -> subprocess.CompletedProcess[str]:
    """pytest run in `folder` on its lab.yaml, as a team runs it, with JUnit to `junit`; pytest's own warnings are
    errors there (record_property's under the default junit_family failed the soak fixture at setup)."""
    args = ["-p", "no:cacheprovider", "-W", "error::pytest.PytestWarning", "--kvrig-lab", "lab.yaml"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, f"--junitxml={junit}"],
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=300,
    )


def test_plugin_is_an_entry_point() -> None:
    (plugin,) = [e for e in entry_points(group="pytest11") if e.name == "kvrig"]
    assert plugin.value == "kvrig.pytest_plugin"


def test_pytest_kvrig_lab_runs_checks_per_phone_with_junit(phones: Phones, tmp_path: Path) -> None:
    lab = {
        "schema": 1,
        "devices": [{"udid": "any"}],
        "matrix": [short_entry(make_ipa(tmp_path / "KVSoak.ipa"))],
        "gates": {"min_max_safe_context": 512},
        "timeouts": FAST,
    }
    (tmp_path / "lab.yaml").write_text(yaml.safe_dump(lab))
    (tmp_path / "test_phones.py").write_text(CHECKS)
    proc = _pytest_lab(tmp_path, "out.xml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = {}
    for case in ET.parse(tmp_path / "out.xml").getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.findall("properties/property")}
        cases.setdefault(case.get("name").split("[")[0], []).append(props)
    pro15, pro13 = phones.pro15.identity.udid, phones.pro13.identity.udid
    assert sorted(p["udid"] for p in cases["test_every_phone_is_known"]) == sorted([pro15, pro13])
    ((soaked,),) = [cases["test_short_soak_completes"]]
    assert soaked["udid"] == pro15 and soaked["profile"] == "iphone-15-pro" and soaked["outcome"] == "completed"
    ((deployed,),) = [cases["test_bundle_is_deployed"]]
    assert deployed["udid"] == pro13 and deployed["host"]


def test_a_lab_phone_that_is_missing_fails_its_tests_instead_of_vanishing(phones: Phones, tmp_path: Path) -> None:
    """`kvrig lab run` fails the runs of a listed phone that is not attached (exit 17); the plugin fails its
    tests the same way, and a lab no attached phone matches fails rather than skipping everything."""
    missing = "00008130-0000DEADBEEF001E"
    for devices, failed in (
        ([{"udid": "any"}, {"udid": missing}], f"device {missing} is not attached"),
        ([{"udid": "any", "profile": "iphone-12"}], "no attached phone matches the lab's devices"),
    ):
        lab = {"schema": 1, "devices": devices, "matrix": [short_entry(make_ipa(tmp_path / "KVSoak.ipa"))]}
        (tmp_path / "lab.yaml").write_text(yaml.safe_dump({**lab, "timeouts": FAST}))
        (tmp_path / "test_phones.py").write_text("def test_a_phone(kvrig_phone):\n    assert kvrig_phone.udid\n")
        proc = _pytest_lab(tmp_path, "o.xml")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        root = ET.parse(tmp_path / "o.xml").getroot()
        # a fixture's failure is a JUnit <error> of the test that asked for it
        messages = [f.get("message", "") for kind in ("failure", "error") for f in root.iter(kind)]
        assert any(failed in m for m in messages), messages
