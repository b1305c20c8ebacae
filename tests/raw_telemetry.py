"""Step records read straight from a telemetry file with `json`, independently of kvrig's reader, so tests
can check what the app wrote against what kvrig reports."""

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
