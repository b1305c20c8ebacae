"""The docs' measured figures are generated (kvrig/docgen.py): every page is as `kvrig docs render` renders it
from docs/data, each measurement was made by the command docs/benchmarks.yaml gives, and no figure that looks
measured stands outside a generated section unless it is a fact of a spec, a setting or a quoted source."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvrig.docgen import SECTION, measure, pages, render_docs, stale_pages

ROOT = Path(__file__).resolve().parents[1]

# A number with the unit of a measurement: a duration, a speed, a ratio, a change, a size, a temperature.
FIGURE = re.compile(
    r"(?<![\w.\-/])[−+\-~]?\d[\d,]*(?:\.\d+)?\s?"
    r"(?:%|tok/s|×|s\b|ms\b|min\b|minutes?\b|seconds?\b|MiB|GiB|KiB|MB|GB|KB|B\b|bytes\b|mnats|°C|PPL)"
)
# Figures that are not measurements made here: settings and defaults, spec facts, published or quoted sources.
# Each is (page, the figure as written); a new one needs a reason as good as these.
NOT_MEASURED = {
    # RAM sizes products are sold with, and limits quoted from the field reports' sources (tests/data/field)
    ("docs/commands.md", "16 GB"),
    ("docs/planning.md", "8 GB"),
    ("docs/planning.md", "6 GB"),
    ("docs/planning.md", "3 GB"),
    ("docs/planning.md", "16 GB"),
    ("docs/planning.md", "~6 GB"),
    ("docs/planning.md", "~2 GB"),
    ("docs/planning.md", "5,461 MiB"),
    ("docs/planning.md", "4,096 MiB"),
    ("docs/planning.md", "2,048 MiB"),
    ("docs/planning.md", "416.00 MiB"),
    ("docs/planning.md", "436,207,616 B"),  # the same bytes, as the field test holds the planner to them
    ("docs/planning.md", "3376 MiB"),
    ("docs/planning.md", "3341 MiB"),
    ("docs/planning.md", "6373 MB"),
    ("docs/planning.md", "8192 MiB"),
    ("docs/planning.md", "16 GiB"),
    ("docs/planning.md", "12 GiB"),
    # the field test's tolerance, MLX's cap and Metal's threshold in MLX's source, the apps' cap in their source
    ("docs/planning.md", "512 MiB"),
    ("docs/planning.md", "2×"),
    ("docs/planning.md", "0.95 ×"),
    ("docs/planning.md", "20 MiB"),
    ("docs/planning.md", "20 MB"),
    # tolerances the tests hold
    ("docs/planning.md", "10 %"),
    ("docs/planning.md", "20 %"),
    # kvrig's settings and defaults
    ("docs/quality.md", "+2 %"),
    ("docs/commands.md", "+2 %"),  # the same setting of --kv auto
    ("docs/quality.md", "10 %"),
    ("docs/engine.md", "20 MiB"),
    ("docs/engine.md", "120 s"),
    ("docs/real-iphone.md", "10 s"),
    ("docs/virtual-iphone.md", "160 MB"),
    ("docs/hostile.md", "1 MiB"),
    ("docs/hostile.md", "16 MiB"),
    ("docs/hostile.md", "64 MiB"),
    ("docs/hostile.md", "5 s"),
    ("docs/hostile.md", "30 s"),
    ("docs/hostile.md", "200 bytes"),
    ("docs/hostile.md", "15 s"),
    ("docs/hostile.md", "10 s"),
    ("examples/README.md", "160 MiB"),
    ("examples/README.md", "128 MiB"),
    ("examples/README.md", "48 MiB"),
    # shapes: a state per layer for keys and one for values
    ("docs/coreml.md", "2×"),
    # a page on iOS
    ("docs/demo.md", "16 KiB"),
    ("examples/README.md", "16 KiB"),
    ("examples/README.md", "32 KiB"),
}


def measured_looking(root: Path) -> list[str]:
    """Figures outside generated sections, fenced blocks and code spans (commands and their options)."""
    found = []
    for page in pages(root):
        name = str(page.relative_to(root))
        text = SECTION.sub("", page.read_text())
        text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for line in text.splitlines():
            for figure in FIGURE.findall(re.sub(r"`[^`]*`", "", line)):
                if (name, figure) not in NOT_MEASURED:
                    found.append(f"{name}: {figure!r} in: {line.strip()[:100]}")
    return found


def test_every_page_is_as_rendered_from_the_measurements() -> None:
    assert not stale_pages(ROOT), stale_pages(ROOT)
    assert any(SECTION.search(p.read_text()) for p in render_docs(ROOT))


def test_no_measured_figure_outside_a_generated_section() -> None:
    assert not measured_looking(ROOT), "\n".join(measured_looking(ROOT))


def test_the_allowed_figures_are_all_still_there() -> None:
    """An allowance a page no longer needs goes, so the list stays the pages' own."""
    text = {str(p.relative_to(ROOT)): p.read_text() for p in pages(ROOT)}
    assert [(page, f) for page, f in sorted(NOT_MEASURED) if f not in text.get(page, "")] == []


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The pages, templates and measurements copied (what `kvrig docs render --check` reads)."""
    for name in ("README.md", "docs", "examples/README.md"):
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, target)
    return tmp_path


def _generated_page(root: Path) -> Path:
    return next(p for p in pages(root) if SECTION.search(p.read_text()))


def test_the_measured_line_names_the_commit_beside_kvrigs_version() -> None:
    """A record's commit is kvrig's tree, not mlx-lm's: the line beside the figures says so."""
    data = json.loads((ROOT / "docs" / "data" / "quality-kv.json").read_text())
    v = data["versions"]
    line = f"kvrig {v['kvrig']} at {data['commit']}, mlx {v['mlx']}, mlx-lm {v['mlx-lm']};"
    assert data["commit"] and line in (ROOT / "docs" / "quality.md").read_text()


def test_no_page_names_the_measuring_checkouts_folder() -> None:
    """The texts kvrig ships are read from the checkout that measured; the pages name them by their place in the
    package, so no page carries a path of the machine that measured."""
    for page, text in render_docs(ROOT).items():
        assert "/kvrig/_texts/" not in text, page
    assert "kvrig/_texts/legal/GPL-3.gz" in (ROOT / "docs/quality.md").read_text()


def test_a_hand_edited_figure_is_stale(checkout: Path) -> None:
    page = _generated_page(checkout)
    text = page.read_text()
    body = SECTION.search(text)
    assert body is not None
    digit = re.search(r"\d", body["body"])
    assert digit is not None
    at = body.start("body") + digit.start()
    page.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :])
    assert stale_pages(checkout) == [f"{page.relative_to(checkout)}: differs from its render"]
    check = [sys.executable, "-m", "kvrig", "docs", "render", "--check", "--root", str(checkout)]
    proc = subprocess.run(check, capture_output=True, text=True)
    assert proc.returncode == 54 and "differs from its render" in proc.stderr, proc.stderr


def test_a_new_measurement_without_a_render_is_stale(checkout: Path) -> None:
    data = next((checkout / "docs" / "data").glob("*.json"))
    data.write_text(re.sub(r'"seconds": [\d.]+', '"seconds": 123456.0', data.read_text(), count=1))
    assert any("differs from its render" in s for s in stale_pages(checkout))


def test_a_measurement_by_other_commands_is_stale(checkout: Path) -> None:
    bench = checkout / "docs" / "benchmarks.yaml"
    bench.write_text(bench.read_text().replace("kvrig bench plan --json", "kvrig bench plan --no-real --json"))
    assert any("measured by other commands" in s for s in stale_pages(checkout))


def test_a_measurement_records_what_the_benchmark_printed(checkout: Path) -> None:
    """Nothing typed in: the result is the command's own JSON, beside the command, the date, versions and load."""
    (checkout / "docs" / "benchmarks.yaml").write_text("profile:\n  run: kvrig profiles show iPhone16,1 --json\n")
    done = measure(checkout, "profile")
    printed = subprocess.run(
        [sys.executable, "-m", "kvrig", "profiles", "show", "iPhone16,1", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    saved = json.loads((checkout / "docs" / "data" / "profile.json").read_text())
    assert saved["result"] == json.loads(printed) == done.result
    assert saved["command"] == "kvrig profiles show iPhone16,1 --json" and saved["before"] == []
    assert {"kvrig", "mlx", "mlx-lm"} <= set(saved["versions"]) and len(saved["host"]["load_before"]) == 3


def test_an_unknown_benchmark_name_is_refused_before_any_runs(checkout: Path) -> None:
    """`kvrig docs measure GOOD TYPO`: the typo is refused (exit 3, naming the registry and the names it has) before
    GOOD spends its minutes, and nothing is written."""
    (checkout / "docs" / "benchmarks.yaml").write_text("profile:\n  run: kvrig profiles show iPhone16,1 --json\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "docs", "measure", "profile", "profil", "--root", str(checkout)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 3, proc.stderr
    assert "benchmarks.yaml: no benchmark 'profil'" in proc.stderr and "expected profile" in proc.stderr
    assert "measuring" not in proc.stderr and not (checkout / "docs" / "data" / "profile.json").exists()


def test_a_section_without_its_end_is_refused_and_the_page_kept(checkout: Path) -> None:
    """Without its closing comment a section would run on to the next one's, and rendering would replace the
    prose between them: `kvrig docs render` refuses (exit 3, naming the page and line) and writes nothing."""
    page = next(p for p in pages(checkout) if len(SECTION.findall(p.read_text())) >= 2)
    text = page.read_text()
    end = text.index("<!-- end generated -->\n")
    page.write_text(text[:end] + text[end + len("<!-- end generated -->\n") :])
    before = page.read_text()
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "docs", "render", "--root", str(checkout)], capture_output=True, text=True
    )
    assert proc.returncode == 3, proc.stderr
    assert str(page) in proc.stderr and "field 'line " in proc.stderr and "Traceback" not in proc.stderr
    assert page.read_text() == before
    stale = subprocess.run(
        [sys.executable, "-m", "kvrig", "docs", "render", "--check", "--root", str(checkout)], capture_output=True
    )
    assert stale.returncode == 3
