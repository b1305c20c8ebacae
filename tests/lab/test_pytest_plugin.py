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
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--kvrig-lab", "lab.yaml", "--junitxml=out.xml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
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
