"""Step records read straight from a telemetry file, and the kill from a pulled JetsamEvent report, with `json`,
independently of kvrig's readers, so tests can check what the app and the kernel wrote against what kvrig
reports."""

from __future__ import annotations

import json
from pathlib import Path


def raw_steps(path: Path) -> list[dict]:
    found = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if record.get("event") == "step":
            found.append(record)
    return found


def raw_kill_footprint(soak_dir: Path) -> tuple[int, int]:
    """(footprint at the kill, page size) from the one JetsamEvent report pulled into `soak_dir`/reports."""
    (report,) = (soak_dir / "reports").glob("JetsamEvent-*.ips")
    header, body = report.read_text().split("\n", 1)
    assert json.loads(header)["bug_type"] == "298"
    data = json.loads(body)
    (victim,) = [p for p in data["processes"] if p.get("reason") == "per-process-limit"]
    page = int(data["memoryStatus"]["pageSize"])
    return int(victim["rpages"]) * page, page
