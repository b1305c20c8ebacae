"""Device profiles: every CSV row has one, values match the CSV, lookups, and errors that name file and field.

The expected values come from tests/data/device_facts.csv (a copy of the project's research table), read here
with the csv module, not from the loader under test.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrig.exceptions import ProfileError
from kvrig.profiles import (
    PROFILE_DIRS,
    DeviceProfile,
    find_profile_by_product_type,
    list_profiles,
    load_profile,
    profiles_dir,
)
from kvrig.schemas import json_schema

ROOT = Path(__file__).resolve().parents[1]
CSV_ROWS = list(csv.DictReader((Path(__file__).parent / "data" / "device_facts.csv").open(newline="")))
MIB, GIB = 1 << 20, 1 << 30
CSV_BASIS = {"measured": "measured", "derived": "derived", "estimate": "estimated", "reported": "reported"}


def csv_product_types(cell: str) -> list[str]:
    family, minors = cell.split(",")
    return [f"{family},{m}" for m in minors.split("/")]


def row_id(row: dict[str, str]) -> str:
    return row["product_type"]


def profile_for(row: dict[str, str]) -> DeviceProfile:
    found = find_profile_by_product_type(csv_product_types(row["product_type"])[0])
    assert found is not None, f"no profile for {row['product_type']}"
    return found


def test_every_csv_row_has_exactly_one_profile():
    profiles = list_profiles()
    assert len(profiles) == len(CSV_ROWS) == 48
    shipped = sorted(pt for p in profiles for pt in p.product_types)
    expected = sorted(pt for row in CSV_ROWS for pt in csv_product_types(row["product_type"]))
    assert shipped == expected  # also: no ProductType in two profiles
    for row in CSV_ROWS:
        for pt in csv_product_types(row["product_type"]):
            assert profile_for({"product_type": pt}).marketing_name == row["marketing_name"]


def test_profile_files_are_named_after_their_profile():
    files = sorted(p.stem for p in (ROOT / "device_profiles").glob("*.yaml"))
    assert files == sorted(p.name for p in list_profiles())
    assert "iphone-15-pro" in files and "ipad-pro-11-m4" in files


@pytest.mark.parametrize("row", CSV_ROWS, ids=row_id)
def test_values_match_the_csv(row):
    p = profile_for(row)
    ram_gb = int(re.match(r"\d+", row["ram_gb"]).group())  # base configuration: "8 (16 on 1/2TB)" -> 8
    assert p.ram == ram_gb * GIB
    assert p.page_size == 16384 and p.page_size_bytes.basis == "derived"
    assert p.baseline > 0 and p.app_baseline_bytes.basis == "estimated"

    if row["gpu_cores"].isdigit():
        assert p.gpu_cores is not None and p.gpu_cores.value == int(row["gpu_cores"])
    else:
        assert p.gpu_cores is None

    if row["mem_bw_gbps"]:
        assert p.memory_bandwidth == pytest.approx(float(row["mem_bw_gbps"]) * 1e9)
    else:
        assert p.memory_bandwidth_bytes_per_s.basis == "estimated"

    default = row["app_limit_default_mb"]
    if default:
        assert p.limit_default == int(default) * MIB
        word = row["default_basis"].split(":")[0].split()[0]
        assert p.app_memory_limit.default_bytes.basis == CSV_BASIS[word]
    else:  # no number in the CSV: the profile must say it is guessing
        assert p.app_memory_limit.default_bytes.basis == "estimated"
        assert "estimate" in p.app_memory_limit.default_bytes.source

    entitled = row["app_limit_entitled_mb"]
    for_base_ram = re.search(rf"(\d+) \({ram_gb}GB\)", entitled)
    if entitled.isdigit():
        assert p.limit_entitled == int(entitled) * MIB
    elif for_base_ram:
        assert p.limit_entitled == int(for_base_ram.group(1)) * MIB
    else:  # unknown, or known only for another RAM configuration
        assert p.limit_entitled is None or p.app_memory_limit.entitled_bytes.basis == "estimated"
    if p.limit_entitled is not None:
        assert p.limit_default <= p.limit_entitled <= p.ram


def test_notes_and_sources_are_kept():
    for row in CSV_ROWS:
        p = profile_for(row)
        if row["notes"]:
            assert row["notes"] in p.notes
        assert len(p.sources) >= 1
        assert "; ".join(p.sources) == row["source"]


def test_convenience_properties():
    p = load_profile("iPhone16,2")  # iPhone 15 Pro Max: EXC_RESOURCE limit=3376 MB measured (CSV)
    assert p.name == "iphone-15-pro-max"
    assert (p.ram, p.limit_default, p.limit_entitled) == (8 * GIB, 3376 * MIB, 6144 * MIB)
    assert p.memory_bandwidth == 51.2e9
    assert isinstance(p.memory_bandwidth, float)
    assert load_profile("iphone-se-3rd-gen").limit_entitled is None


def test_lookup_by_product_type_name_and_path(tmp_path, monkeypatch):
    assert load_profile("iPhone16,1").name == "iphone-15-pro"
    assert load_profile("iphone16,1").name == "iphone-15-pro"
    assert load_profile("iPad16,4").name == "ipad-pro-11-m4"
    assert load_profile("iphone-15-pro").product_types == ["iPhone16,1"]
    path = ROOT / "device_profiles" / "ipad-air-5th-gen.yaml"
    assert load_profile(path).product_types == ["iPad13,16", "iPad13,17"]
    assert load_profile(str(path)).name == "ipad-air-5th-gen"
    # a profile outside the shipped folder, under any file name
    own = tmp_path / "my-phone.yml"
    own.write_text(path.read_text())
    assert load_profile(own).name == "ipad-air-5th-gen"
    assert find_profile_by_product_type("iPhone99,9") is None
    # named as a user types it in the folder that holds it: JSON (which YAML reads), or no suffix at all
    for name in ("my-phone.json", "my-phone"):
        (tmp_path / name).write_text(json.dumps(yaml.safe_load(path.read_text())))
        with monkeypatch.context() as patch:
            patch.chdir(tmp_path)
            assert load_profile(name).name == "ipad-air-5th-gen"


def test_loader_prefers_the_wheel_data_folder_then_the_repo():
    assert PROFILE_DIRS[0].parts[-3:] == ("kvrig", "_data", "device_profiles")
    assert profiles_dir() == ROOT / "device_profiles"  # source checkout: no _data folder


@pytest.mark.parametrize(
    ("ref", "suggested"),
    [("iphone-15-pr", "iphone-15-pro"), ("iphone15pro", "iphone-15-pro"), ("iPhone16,9", "iPhone16,1")],
)
def test_unknown_ref_suggests_close_names(ref, suggested):
    with pytest.raises(ProfileError) as err:
        load_profile(ref)
    assert f"'{ref}'" in str(err.value)
    assert suggested in str(err.value)
    assert "kvrig profiles list" in str(err.value)
    assert err.value.exit_code == 3


def write_variant(tmp_path: Path, edit: Any) -> Path:
    data = yaml.safe_load((ROOT / "device_profiles" / "iphone-15-pro.yaml").read_text())
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _typo(d: dict[str, Any]) -> None:
    d["ram_byte"] = d.pop("ram_bytes")


def _nested_typo(d: dict[str, Any]) -> None:
    d["app_memory_limit"]["default_bytes"]["valeu"] = d["app_memory_limit"]["default_bytes"].pop("value")


def _wrong_type(d: dict[str, Any]) -> None:
    d["ram_bytes"]["value"] = "8 GB"


def _bad_basis(d: dict[str, Any]) -> None:
    d["memory_bandwidth_bytes_per_s"]["basis"] = "guessed"


def _missing(d: dict[str, Any]) -> None:
    del d["chip"]


def _limit_above_ram(d: dict[str, Any]) -> None:
    d["app_memory_limit"]["default_bytes"]["value"] = 9 * GIB


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (_typo, "ram_byte", ["unknown key", "did you mean 'ram_bytes'"]),
        (_nested_typo, "app_memory_limit.default_bytes.valeu", ["unknown key"]),
        (_wrong_type, "ram_bytes.value", ["valid integer", "'8 GB'"]),
        (_bad_basis, "memory_bandwidth_bytes_per_s.basis", ["'measured'", "'guessed'"]),
        (_missing, "chip", ["missing"]),
        (_limit_above_ram, None, ["default_bytes exceeds ram_bytes"]),
    ],
    ids=["typo", "nested-typo", "wrong-type", "bad-basis", "missing", "limit-above-ram"],
)
def test_bad_profile_names_file_and_field(tmp_path, edit, field, words):
    path = write_variant(tmp_path, edit)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert err.value.file == str(path)
    assert err.value.field == field
    assert str(path) in str(err.value)
    if field is not None:
        assert f"field '{field}'" in str(err.value)
    else:  # a check across fields names no one field, in its own words (not "Value error, ..., got dict")
        assert "field" not in str(err.value) and "Value error" not in str(err.value) and "dict" not in str(err.value)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [("schema: [1\n", "not valid YAML"), ("- just a list\n", "expected a mapping"), (None, "file not found")],
)
def test_unreadable_profile_file(tmp_path, text, words):
    path = tmp_path / "broken.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ProfileError, match=words) as err:
        load_profile(path)
    assert err.value.file == str(path)


def test_committed_json_schema_is_current():
    committed = json.loads((ROOT / "device_profiles" / "device-profile.schema.json").read_text())
    schema = json_schema(DeviceProfile)
    assert committed == schema
    assert schema["additionalProperties"] is False
    assert "ram_bytes" in schema["required"] and "schema" in schema["required"]


def test_wheel_ships_the_profiles(tmp_path):
    """Builds the wheel from a copy of the project and loads profiles from the unpacked wheel alone."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("kvrig", "device_profiles", "templates"):
        if (ROOT / folder).is_dir():
            shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    # pyproject force-includes templates/; another part of the project adds it, the wheel must still build.
    (src / "templates").mkdir(exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=src,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvrig-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if n.startswith("kvrig/_data/device_profiles/")}
        zf.extractall(tmp_path / "installed")
    expected = {f"kvrig/_data/device_profiles/{p.name}" for p in (ROOT / "device_profiles").iterdir()}
    assert shipped == expected
    code = (
        "import kvrig.profiles as m; print(m.profiles_dir()); print(len(m.list_profiles()));"
        "print(m.load_profile('iPhone16,1').name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "installed"), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == [
        str(tmp_path / "installed" / "kvrig" / "_data" / "device_profiles"),
        "48",
        "iphone-15-pro",
    ]
