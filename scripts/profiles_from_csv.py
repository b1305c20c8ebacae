"""Writes one device profile YAML per row of a device-facts CSV.

    python scripts/profiles_from_csv.py path/to/device_facts.csv device_profiles/

Used once to create `device_profiles/`; the YAML files are the source of truth afterwards (edit them by
hand). Every number keeps the CSV's basis text as its `source`; where the CSV has no value the number is
either left out (null) or filled with an estimate marked `estimated` whose reasoning is spelled out below.
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path
from typing import Any

import yaml

MIB = 1 << 20
GIB = 1 << 30

# Values the CSV leaves empty that a profile cannot do without (the default limit drives every plan, the
# bandwidth drives the decode-speed ceiling). Each is an explicit, reasoned estimate.
ESTIMATE_12GB_IPHONE_LIMIT = (
    3376,
    "estimate: no public measurement for 12 GB iPhones; lower bound from the 8 GB class (3376 MB measured "
    "on iPhone 15 Pro Max and 16 Pro), since measured defaults never fell with more RAM "
    "(4 GB: 2091, 6 GB: 3064, 8 GB: 3376)",
)
ESTIMATE_8GB_IPAD_LIMIT = (
    5089,
    "estimate: 8 GB iPad class crash amount (5089 MB, listed for iPad14,3 and iPad16,3); note the report of "
    "~3 GB on iPadOS 26.4/26.5 for an unstated 8 GB iPad",
)
ESTIMATE_12GB_IPAD_LIMIT = (
    5089,
    "estimate: no public measurement for 12 GB iPads; lower bound from the 8 GB iPad class (5089 MB), "
    "16 GB iPad Pro measured 8192 MB without the entitlement",
)
DEFAULT_LIMIT_ESTIMATES: dict[str, tuple[int, str]] = {
    "iPhone18,4": ESTIMATE_12GB_IPHONE_LIMIT,
    "iPhone18,1": ESTIMATE_12GB_IPHONE_LIMIT,
    "iPhone18,2": ESTIMATE_12GB_IPHONE_LIMIT,
    "iPad13,16/17": ESTIMATE_8GB_IPAD_LIMIT,
    "iPad14,8/9/10/11": ESTIMATE_8GB_IPAD_LIMIT,
    "iPad15,3/4/5/6": ESTIMATE_8GB_IPAD_LIMIT,
    "iPad16,1/2": ESTIMATE_8GB_IPAD_LIMIT,
    "iPad16,8/9/10/11": ESTIMATE_12GB_IPAD_LIMIT,
    "iPad17,1/2": ESTIMATE_12GB_IPAD_LIMIT,
}
BANDWIDTH_ESTIMATES: dict[str, tuple[float, str]] = {
    "iPhone18,4": (
        68.3,
        "estimate: leak says the Air's LPDDR5X runs below 9600 MT/s; assume 8533 MT/s x 64-bit = 68.3 GB/s "
        "as reported for the A19",
    ),
    "iPhone18,5": (
        60.0,
        "estimate: LPDDR5X of unknown speed on a possibly binned A19; conservatively LPDDR5X-7500 x 64-bit "
        "= 60.0 GB/s as in iPhone 16e",
    ),
}

PAGE_SIZE = {
    "value": 16384,
    "basis": "derived",
    "source": "16 KiB VM pages on every A9 and later SoC (arm64 iOS/iPadOS vm_page_size); consistent with "
    "JetsamEvent rpages x 16 KiB = per-process limit (UTM issue 7864, iPad13,16)",
}
BASELINE = {
    "value": 100 * MIB,
    "basis": "estimated",
    "source": "estimate: no public figure for an MLX-Swift SwiftUI app before weights; an empty SwiftUI "
    "app's phys_footprint is a few tens of MB, linking MLX adds the Metal device, default.metallib and "
    "compiled pipelines; rounded up to 100 MiB (buffer cache and activations are counted separately). "
    "Calibrate from soak telemetry (phys_footprint at start)",
}

OS_RE = re.compile(r"\b(iPadOS|iOS) (\d+(?:\.\d+)*)(?:[-/](\d+(?:\.\d+)*))?")


def slug(marketing_name: str) -> str:
    """'iPad Pro 11-inch (M4)' -> 'ipad-pro-11-m4'."""
    text = marketing_name.lower().replace("-inch", "")
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def product_types(cell: str) -> list[str]:
    """'iPad13,4/5/6/7' -> ['iPad13,4', 'iPad13,5', 'iPad13,6', 'iPad13,7']."""
    family, _, minors = cell.partition(",")
    return [f"{family},{minor}" for minor in minors.split("/")]


def split_sources(cell: str) -> list[str]:
    """Splits at '; ' outside parentheses (the references themselves contain semicolons)."""
    parts, depth, current = [], 0, ""
    for i, ch in enumerate(cell):
        depth += ch == "("
        depth -= ch == ")"
        if ch == ";" and depth == 0 and cell[i + 1 : i + 2] == " ":
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return [p for p in parts if p]


def basis_of(text: str) -> str:
    word = text.strip().lower()
    for prefix, basis in (
        ("measured", "measured"),
        ("derived", "derived"),
        ("estimate", "estimated"),
        ("reported", "reported"),
        ("leak", "reported"),
        ("apple spec", "published"),
    ):
        if word.startswith(prefix):
            return basis
    raise ValueError(f"no basis word at the start of {text!r}")


def first_number(cell: str) -> float | None:
    match = re.search(r"\d+(?:\.\d+)?", cell)
    return float(match.group()) if match else None


def sourced(value: Any, basis: str, source: str) -> dict[str, Any]:
    return {"value": value, "basis": basis, "source": source}


def limit(cell: str, basis_text: str, ram_gb: int, what: str, notes: list[str]) -> dict[str, Any] | None:
    """A limit cell in MB: '2150', '6144 (8GB) / 12288 (16GB)', '~16384 (16GB model)' or empty."""
    cell = cell.strip()
    if re.fullmatch(r"\d+", cell):
        return sourced(int(cell) * MIB, basis_of(basis_text), basis_text)
    per_ram = re.search(rf"(\d+) \({ram_gb}GB\)", cell)
    if per_ram:
        notes.append(f"{what} limit by RAM: {cell} MB ({basis_text})")
        return sourced(int(per_ram.group(1)) * MIB, basis_of(basis_text), basis_text)
    if cell:  # a value for another RAM configuration only
        notes.append(f"{what} limit of the other RAM configuration: {cell} MB ({basis_text})")
        return None
    estimate = re.search(r"estimate ~(\d+)", basis_text)
    if estimate:
        return sourced(int(estimate.group(1)) * MIB, "estimated", f"CSV: {basis_text}")
    return None


def os_seen(texts: list[str]) -> dict[str, Any] | None:
    found: dict[str, list[tuple[int, ...]]] = {}
    for text in texts:
        if "unstated" in text or text.startswith("see "):  # about another model, or a cross-reference
            continue
        for os_name, low, high in OS_RE.findall(text):
            for version in (low, high):
                if version:
                    found.setdefault(os_name, []).append(tuple(int(p) for p in version.split(".")))
    if not found:
        return None
    ranges = []
    for os_name, versions in found.items():
        lo, hi = (".".join(map(str, v)) for v in (min(versions), max(versions)))
        ranges.append(f"{os_name} {lo}" if lo == hi else f"{os_name} {lo}-{hi}")
    return sourced(", ".join(ranges), "reported", "OS versions named in this device's limit reports")


def profile(row: dict[str, str]) -> dict[str, Any]:
    key = row["product_type"]
    notes = [row["notes"]] if row["notes"] else []
    ram_cell = row["ram_gb"]
    ram_gb = int(first_number(ram_cell) or 0)
    if "(" in ram_cell and "estimate" not in ram_cell:
        notes.append(f"RAM {ram_cell} GB: this profile describes the base configuration ({ram_gb} GB)")
    ram_basis = "estimated" if "estimate" in ram_cell else "reported"
    ram = sourced(ram_gb * GIB, ram_basis, f"CSV ram_gb '{ram_cell}'; Xcode device data and press reports")

    gpu = first_number(row["gpu_cores"])
    bw_cell = row["mem_bw_gbps"]
    if bw_cell:
        bw_source = f"{row['bw_basis']} ({row['lpddr']})"
        bandwidth = sourced(round(float(bw_cell) * 1e9), basis_of(row["bw_basis"]), bw_source)
    else:
        gbps, why = BANDWIDTH_ESTIMATES[key]
        bandwidth = sourced(round(gbps * 1e9), "estimated", f"{why} (CSV: {row['bw_basis']}; {row['lpddr']})")

    default = limit(row["app_limit_default_mb"], row["default_basis"], ram_gb, "default", notes)
    if default is None:
        mb, why = DEFAULT_LIMIT_ESTIMATES[key]
        default = sourced(mb * MIB, "estimated", f"{why} (CSV: {row['default_basis']})")
    entitled = limit(row["app_limit_entitled_mb"], row["entitled_basis"], ram_gb, "entitled", notes)

    out: dict[str, Any] = {
        "schema": 1,
        "name": slug(row["marketing_name"]),
        "marketing_name": row["marketing_name"],
        "product_types": product_types(key),
        "chip": row["chip"],
        "ram_bytes": ram,
        "gpu_cores": sourced(int(gpu), "reported", "CSV gpu_cores; Apple and press reports") if gpu else None,
        "memory_bandwidth_bytes_per_s": bandwidth,
        "page_size_bytes": PAGE_SIZE,
        "app_memory_limit": {"default_bytes": default, "entitled_bytes": entitled},
        "app_baseline_bytes": BASELINE,
    }
    seen = os_seen([row["default_basis"], row["entitled_basis"], row["notes"]])
    if seen:
        out["os_seen"] = seen
    out["notes"] = notes
    out["sources"] = split_sources(row["source"])
    return out


HEADER = """\
# yaml-language-server: $schema=device-profile.schema.json
# Device profile (kvrig). Every number: value, basis (measured|derived|estimated|reported|published) and
# source (the evidence; references are listed under `sources`). Limits in bytes (CSV MB = MiB).
"""


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: profiles_from_csv.py DEVICE_FACTS_CSV OUT_DIR")
    csv_path, out_dir = Path(argv[0]), Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    with csv_path.open(newline="") as f:
        for row in csv.DictReader(f):
            data = profile(row)
            text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=110)
            (out_dir / f"{data['name']}.yaml").write_text(HEADER + text)
            print(out_dir / f"{data['name']}.yaml")


if __name__ == "__main__":
    main(sys.argv[1:])
