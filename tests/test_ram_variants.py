"""Issue 23: profiles from the A12 on, and products sold with two RAM sizes under the same ProductTypes (`--ram`,
`REF@NGB`). Expected numbers come from tests/data/device_facts.csv (the research table, read with the csv module)
and from the published crash-test table it cites, not from the loader."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import yaml

from kvrig.exceptions import ProfileError
from kvrig.profiles import load_profile
from tests.cli_run import run

CSV_ROWS = list(csv.DictReader((Path(__file__).parent / "data" / "device_facts.csv").open(newline="")))
MIB, GIB = 1 << 20, 1 << 30
# stackoverflow.com/questions/5887248/ios-app-maximum-memory-budget/15200855: crash amount MB per device
CRASH_TEST = {"iPhone11,2": 2040, "iPhone11,4": 2039, "iPhone11,6": 2039, "iPhone11,8": 1792, "iPhone12,1": 2068}
CRASH_TEST["iPhone12,5"] = 2067


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


def test_every_iphone_from_the_a12_on_has_a_profile() -> None:
    for product_type in ("iPhone11,2", "iPhone11,4", "iPhone11,6", "iPhone11,8", "iPhone12,1", "iPhone12,3"):
        assert load_profile(product_type).chip.startswith(("A12", "A13"))
    assert load_profile("iPhone12,5").marketing_name == "iPhone 11 Pro Max"
    assert load_profile("iPhone12,8").ram == 3 * GIB  # SE (2nd gen)
    for product_type, mb in CRASH_TEST.items():
        limit = load_profile(product_type).app_memory_limit.default_bytes
        assert (limit.value, limit.basis) == (mb * MIB, "reported")
        assert "stackoverflow.com/questions/5887248" in " ".join(load_profile(product_type).sources)
    # No source for these two: an estimate that says so, and no entitled limit at all.
    for product_type in ("iPhone12,3", "iPhone12,8"):
        p = load_profile(product_type)
        assert p.app_memory_limit.default_bytes.basis == "estimated"
        assert p.app_memory_limit.default_bytes.source.startswith("estimate: no measurement")
        assert p.limit_entitled is None


def _sixteen_gb_rows() -> list[tuple[str, int | None]]:
    """(first ProductType, the 16 GB configuration's entitled MB or None) for every row sold with 16 GB besides."""
    rows = []
    for row in CSV_ROWS:
        if "16 on 1/2TB" not in row["ram_gb"]:
            continue
        family, minors = row["product_type"].split(",")
        found = re.search(r"(\d+) \(16GB", row["app_limit_entitled_mb"])
        rows.append((f"{family},{minors.split('/')[0]}", int(found.group(1)) if found else None))
    return rows


@pytest.mark.parametrize(("product_type", "entitled_mb"), _sixteen_gb_rows())
def test_the_16_gb_configuration_has_its_own_limits(product_type: str, entitled_mb: int | None) -> None:
    base, big = load_profile(product_type), load_profile(f"{product_type}@16GB")
    assert base.ram < big.ram == 16 * GIB
    assert big.product_types == base.product_types and big.ram_sizes_gb[0] == 16
    assert sorted(big.ram_sizes_gb) == sorted(base.ram_sizes_gb)
    assert big.limit_entitled == (entitled_mb * MIB if entitled_mb else None)
    assert load_profile(product_type, 16) == big
    assert load_profile(base.name, base.ram // GIB) == base
    assert big.app_memory_limit.default_bytes.source and big.ram_bytes.source


def test_a_size_the_product_was_not_sold_with_is_refused() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile("iPhone16,1@16GB")
    assert caught.value.field == "ram" and "8 GB" in str(caught.value)
    with pytest.raises(ProfileError, match="names 16 GB but 8 GB"):
        load_profile("iPad16,3@16GB", 8)


def test_plan_with_ram_plans_that_configuration(capsys) -> None:
    code, out, _ = run(
        capsys, "plan", "--device", "iPad16,3", "--ram", "16", "--schemes", "k8v4", "--contexts", "4096", "--json"
    )
    assert code == 0
    device = json.loads(out)["device"]
    row = next(r for r in CSV_ROWS if r["product_type"] == "iPad16,3/4")
    assert device["ram_bytes"] == 16 * GIB and device["ram_configurations_gb"] == [16, 8]
    assert device["limit_entitled_bytes"] == int(re.search(r"(\d+) \(16GB", row["app_limit_entitled_mb"])[1]) * MIB
    code, out, _ = run(capsys, "plan", "--device", "iPad16,3", "--schemes", "k8v4", "--contexts", "4096", "--json")
    assert json.loads(out)["device"]["ram_bytes"] == 8 * GIB
    code, _, err = run(capsys, "plan", "--device", "iPhone16,1", "--ram", "12", "--schemes", "k8v4")
    assert code == 3 and "field 'ram'" in err


def test_list_names_each_configuration_and_every_source(capsys) -> None:
    code, out, _ = run(capsys, "--no-color", "profiles", "list", "--sources")
    assert code == 0
    assert "ipad-pro-11-m4@16GB" in out and "iphone-xr" in out
    block = out[out.index("\niphone-11-pro\n") :]
    assert "entitled: unknown (no source gives it)" in block.split("\niphone-11-pro-max\n")[0]
    assert "sources: " in block


def test_ram_variants_need_schema_2(tmp_path: Path) -> None:
    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "device_profiles" / "ipad-pro-11-m4.yaml").read_text())
    data["schema"] = 1
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="schema-2 field"):
        load_profile(path)


def test_a_lab_device_names_its_ram() -> None:
    """A phone reports its ProductType, not its RAM: the lab file's profile `REF@16GB` plans that configuration."""
    from kvrig.lab.predict import Predictor
    from kvrig.schemas.lab import LabDevice, MatrixEntry

    model = Path(__file__).parent / "data" / "field" / "configs" / "qwen3-1.7b.json"
    entry = MatrixEntry.model_validate({"app_id": "com.example.app", "model": str(model), "schemes": ["fp16"]})
    predicted = {
        ref: Predictor([]).predict(entry, entry.schemes[0], "ipad-pro-11-m4", LabDevice(udid="any", profile=ref))
        for ref in ("ipad-pro-11-m4", "ipad-pro-11-m4@16GB")
    }
    base, big = predicted["ipad-pro-11-m4"], predicted["ipad-pro-11-m4@16GB"]
    assert base is not None and big is not None
    # the lab plans against the default limit: the 16 GB model's EXC_RESOURCE limit, the base model's estimate
    assert (base.limit_bytes, big.limit_bytes) == (load_profile("iPad16,3").limit_default, 8192 * MIB)
    assert big.max_context > base.max_context
