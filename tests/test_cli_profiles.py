"""`kvrig profiles list|show|schema`: tables, JSON, and exit code 3 on a bad profile."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from kvrig.profiles import DeviceProfile
from tests.cli_run import run

ROOT = Path(__file__).resolve().parents[1]
CSV_ROWS = list(csv.DictReader((Path(__file__).parent / "data" / "device_facts.csv").open(newline="")))
MIB = 1 << 20


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich would otherwise wrap names at 80 columns


def test_list_json_has_every_csv_device(capsys):
    code, out, _ = run(capsys, "profiles", "list", "--json")
    assert code == 0
    profiles = json.loads(out)
    assert len(profiles) == len(CSV_ROWS)
    by_pt = {pt: p for p in profiles for pt in p["product_types"]}
    fifteen_pro_max = by_pt["iPhone16,2"]
    row = next(r for r in CSV_ROWS if r["product_type"] == "iPhone16,2")
    assert fifteen_pro_max["schema"] == 1
    assert fifteen_pro_max["app_memory_limit"]["default_bytes"]["value"] == int(row["app_limit_default_mb"]) * MIB
    assert fifteen_pro_max["app_memory_limit"]["default_bytes"]["basis"] == "measured"


def test_list_table(capsys):
    code, out, _ = run(capsys, "profiles", "list")
    assert code == 0
    line = next(ln for ln in out.splitlines() if "iphone-15-pro-max" in ln)
    assert "iPhone16,2" in line and "A17 Pro" in line and "3376 MiB" in line and "8.0 GiB" in line
    ipad = next(ln for ln in out.splitlines() if "ipad-pro-11-m4" in ln)
    assert "iPad16,3 iPad16,4" in ipad and "unknown" in ipad  # entitled limit of the 8 GB model not known
    assert "~3376 MiB" in next(ln for ln in out.splitlines() if "iphone-17-pro-max" in ln)  # estimate marked


def test_show_every_field_with_basis_and_source(capsys):
    code, out, _ = run(capsys, "profiles", "show", "iPhone16,1")
    assert code == 0
    assert "iPhone 15 Pro (iphone-15-pro)" in out
    for field in ("ram_bytes", "memory_bandwidth_bytes_per_s", "page_size_bytes", "app_baseline_bytes"):
        assert field in out
    assert "app_memory_limit.default_bytes" in out and "3376 MiB" in out and "measured" in out
    assert "rtabmap" in out  # the source text of the entitled limit
    assert "sources" in out and "github.com/introlab/rtabmap/pull/1446" in out


def test_show_json_round_trips(capsys):
    code, out, _ = run(capsys, "profiles", "show", "ipad-pro-11-m4", "--json")
    assert code == 0
    data = json.loads(out)
    assert DeviceProfile.model_validate(data).product_types == ["iPad16,3", "iPad16,4"]


def test_schema_command_accepts_every_shipped_profile_and_refuses_unknown_keys(capsys):
    """The printed schema, read by another validator (jsonschema), as an editor reads it from the YAML header."""
    code, out, _ = run(capsys, "profiles", "schema")
    assert code == 0
    validator = jsonschema.Draft202012Validator(json.loads(out))
    shipped = sorted((ROOT / "device_profiles").glob("*.yaml"))
    assert len(shipped) > 20
    for path in shipped:
        errors = [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
        assert errors == [], path.name
    profile = yaml.safe_load(shipped[0].read_text())
    assert not validator.is_valid({**profile, "ram_gb": 8})
    assert not validator.is_valid({k: v for k, v in profile.items() if k != "ram_bytes"})
    assert not validator.is_valid({**profile, "ram_bytes": {**profile["ram_bytes"], "basis": "guessed"}})


def test_unknown_profile_exit_3_with_suggestion(capsys):
    code, _, err = run(capsys, "profiles", "show", "iphone-15-pr")
    assert code == 3
    assert "iphone-15-pro" in err and "kvrig profiles list" in err


def test_bad_profile_file_exit_3_without_traceback(tmp_path):
    bad = tmp_path / "phone.yaml"
    good = (ROOT / "device_profiles" / "iphone-15-pro.yaml").read_text()
    bad.write_text(good.replace("chip: A17 Pro", "chip: A17 Pro\nchips: 2"))
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "profiles", "show", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 3
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("kvrig: error: ")
    assert str(bad) in proc.stderr and "field 'chips'" in proc.stderr and "unknown key" in proc.stderr
