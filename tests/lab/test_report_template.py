"""report.html from its jinja2 template: every run in the table with its host, names escaped, notes shown."""

from __future__ import annotations

import html.parser
from pathlib import Path

from kvrig.lab.report import write_report
from kvrig.schemas.lab import LabRecord
from kvrig.schemas.results import DeviceRef, ResultsFile, SoakResult


class Cells(html.parser.HTMLParser):
    """The text of every table row, and every <script> tag seen (there must be none)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.scripts = 0
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "script":
            self.scripts += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def test_report_lists_each_run_with_host_and_escapes_names(tmp_path: Path) -> None:
    hostile = "<script>alert(1)</script>"
    runs = [
        SoakResult(
            run_id=f"r{i}",
            device=DeviceRef(udid=f"UDID-{i}", profile="iphone-15-pro", host=host),
            app_id="dev.kvrig.soak",
            scheme="fp16",
            entry=hostile if i == 0 else "short",
            outcome="completed",
            max_context_reached=512,
            max_safe_context=512,
        )
        for i, host in enumerate(["mini-a", "mini-b"])
    ]
    record = LabRecord(name="two-hosts", hosts=["mini-a", "mini-b"], notes=["host mini-c: unreachable"])
    path = write_report(ResultsFile(tool_version="0", runs=runs, lab=record), tmp_path, title="lab & shards")
    text = path.read_text()
    parser = Cells()
    parser.feed(text)
    header, *rows = parser.rows
    assert header[:3] == ["State", "Host", "Device"]
    assert [(r[1], r[2], r[4]) for r in rows] == [("mini-a", "UDID-0", hostile), ("mini-b", "UDID-1", "short")]
    assert parser.scripts == 0 and "&lt;script&gt;" in text  # shown as text, never run
    assert "<title>lab &amp; shards</title>" in text and "host mini-c: unreachable" in text


def test_thermal_figure_only_for_runs_with_battery_samples(tmp_path: Path) -> None:
    from kvrig.schemas.results import BatterySample, TpsPoint

    t0 = 1_700_000_000.0
    hot = SoakResult(
        run_id="hot",
        device=DeviceRef(udid="UDID-HOT", profile="iphone-15-pro"),
        app_id="dev.kvrig.soak",
        scheme="k8v4",
        outcome="completed",
        max_context_reached=512,
        tps_curve=[TpsPoint(context_tokens=256 * (i + 1), t=t0 + 10 * i, decode_tps=20.0 - i) for i in range(2)],
        battery=[BatterySample(t=t0 + 5 * i, temperature_c=30.0 + i) for i in range(4)],
    )
    cold = hot.model_copy(update={"run_id": "cold", "device": DeviceRef(udid="UDID-COLD"), "battery": []})
    path = write_report(ResultsFile(tool_version="0", runs=[hot, cold]), tmp_path)
    images = sorted(p.name for p in (tmp_path / "report").glob("*thermal*.png"))
    assert len(images) == 1 and "udid-hot" in images[0].lower()
    assert f"report/{images[0]}" in path.read_text()


def test_the_report_goes_only_where_nothing_else_is(tmp_path: Path) -> None:
    """An empty folder, a lab's output or an earlier report take the report; a folder of other files is refused
    before anything is written into it."""
    import pytest

    from kvrig.exceptions import ReportFolderError

    results = ResultsFile(tool_version="0", runs=[])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ReportFolderError):
        write_report(results, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    report = write_report(results, tmp_path / "new")
    assert write_report(results, report.parent) == report  # again, over an earlier report
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "results.json").write_text("{}")
    assert write_report(results, lab).is_file()  # the lab's own folder
