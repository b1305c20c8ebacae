"""Golden tree for the reference configuration: file list and content hashes of the generated project.

Regenerate after an intended template change: KVRIG_UPDATE_GOLDEN=1 pytest tests/appgen/test_golden.py
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import kvrig

GOLDEN = Path(__file__).parent / "golden" / "reference-tree.json"


def tree(project: Path) -> dict[str, str]:
    listing = {}
    for path in sorted(project.rglob("*")):
        if path.is_file():
            # The generator's version is stamped into some files; hash with it masked so a release bump alone
            # does not change the tree.
            text = path.read_text().replace(kvrig.__version__, "<version>")
            listing[path.relative_to(project).as_posix()] = hashlib.sha256(text.encode()).hexdigest()
    return listing


def test_reference_tree_matches_golden(reference_project: Path) -> None:
    current = tree(reference_project)
    if os.environ.get("KVRIG_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
        pytest.skip("the reference tree regenerated: review its diff")  # nothing was compared
    golden = json.loads(GOLDEN.read_text())
    assert sorted(current) == sorted(golden), "files added or removed (KVRIG_UPDATE_GOLDEN=1 to accept)"
    changed = [name for name in golden if golden[name] != current[name]]
    assert changed == [], f"changed: {changed} (KVRIG_UPDATE_GOLDEN=1 to accept)"
