"""junit.xml as CI servers read it (issues found by running GitLab's, Jenkins' and two GitHub actions' readers on
kvrig's output): one character XML 1.0 forbids made Jenkins and GitLab drop the whole file; runs `kvrig lab`
fails read as skipped (passed, to CI); a merge's missing shard or conflict was not in the file at all."""

from __future__ import annotations

import os
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import xmlschema

from kvrig.lab.junit import write_junit
from kvrig.schemas.lab import Gates, LabRecord
from kvrig.schemas.results import DeviceRef, ResultsFile, SoakResult

JUNIT_XSD = Path(__file__).resolve().parents[1] / "data" / "junit.xsd"


def run(i: int, **fields: object) -> SoakResult:
    base: dict[str, object] = {
        "run_id": f"r{i}",
        "device": DeviceRef(udid="UDID-1", profile="iphone-15-pro", host="mini-a"),
        "app_id": "dev.kvrig.soak",
        "scheme": "k8v4",
        "entry": "grow",
        "started": 1_780_000_000.0,
        "finished": 1_780_000_060.0,
    }
    return SoakResult(**{**base, **fields})  # type: ignore[arg-type]


def written(tmp_path: Path, runs: list[SoakResult], **options: object) -> ET.Element:
    path = write_junit(
        ResultsFile(tool_version="0", runs=runs, lab=LabRecord(name="lab")), tmp_path / "j.xml", **options
    )  # type: ignore[arg-type]
    xmlschema.XMLSchema(str(JUNIT_XSD)).validate(str(path))
    return ET.parse(path).getroot()  # expat refuses what Jenkins' and GitLab's parsers refuse


def test_characters_xml_cannot_carry_are_dropped_not_written(tmp_path: Path) -> None:
    message = "Metal: \x1b[31mInsufficient Permission\x1b[0m\x00 (to submit GPU work from background)\ud83d"
    root = written(tmp_path, [run(0, outcome="crash", outcome_detail=message), run(1, error="lost \x07 it")])
    failure = next(root.iter("failure"))
    assert "Insufficient Permission" in failure.get("message", "") and "\x1b" not in failure.get("message", "")
    assert "\x07" not in next(root.iter("error")).get("message", "")


def test_a_run_never_run_is_an_error_as_kvrig_lab_counts_it(tmp_path: Path) -> None:
    root = written(tmp_path, [run(0, outcome="completed", max_safe_context=512), run(1, scheme="fp16")])
    (error,) = root.iter("error")
    assert error.get("type") == "not-run" and not list(root.iter("skipped"))
    assert (root.get("tests"), root.get("errors"), root.get("failures")) == ("2", "1", "0")
    assert root.get("skipped") is None  # junit-10.xsd gives <testsuites> no such attribute


def test_what_a_merge_found_wrong_is_a_case_of_its_own(tmp_path: Path) -> None:
    runs = [run(0, outcome="completed"), run(1, outcome="jetsam")]  # a conflict: both kept, one name
    problems = [("conflict", "UDID-1 grow[k8v4]: completed; jetsam (both kept)"), ("missing-shard", "2/2")]
    root = written(tmp_path, runs, problems=problems)
    names = [c.get("name") for c in root.iter("testcase")]
    assert len(names) == len(set(names)) == 4  # GitLab keys cases by suite, class and name
    merge = next(s for s in root.iter("testsuite") if s.get("name") == "kvrig lab merge")
    assert [e.get("type") for e in merge.iter("error")] == ["conflict", "missing-shard"]
    assert (root.get("tests"), root.get("errors")) == ("4", "2")


def test_every_reason_in_the_one_failure_readers_show(tmp_path: Path) -> None:
    gated = run(0, outcome="crash", outcome_detail="SIGSEGV")
    record = LabRecord(name="lab", gates={"grow": Gates(min_max_safe_context=4096)})
    from kvrig.lab.save import evaluate_gates

    results = ResultsFile(tool_version="0", runs=[gated], lab=record)
    evaluate_gates(results)
    path = write_junit(results, tmp_path / "j.xml")
    (failure,) = ET.parse(path).getroot().iter("failure")
    assert "crash" in (failure.text or "") and "min_max_safe_context" in (failure.text or ""), failure.text


def test_the_suite_timestamp_is_utc_whatever_the_host_zone(tmp_path: Path) -> None:
    original = os.environ.get("TZ")
    os.environ["TZ"] = "America/Los_Angeles"
    time.tzset()
    try:
        root = written(tmp_path, [run(0, outcome="completed")])
    finally:
        if original is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = original
        time.tzset()
    assert next(root.iter("testsuite")).get("timestamp") == "2026-05-28T20:26:40"  # 1,780,000,000 s, in UTC


def test_the_report_page_drops_them_too(tmp_path: Path) -> None:
    """The HTML report prints the same messages: the W3C checker refuses U+001B and U+0000 in a page."""
    from kvrig.lab.report import write_report

    bad = run(0, outcome="crash", outcome_detail="abort \x1b[31mred\x1b[0m \x00 <b>&</b>")
    page = write_report(ResultsFile(tool_version="0", runs=[bad], lab=LabRecord(name="lab")), tmp_path).read_text()
    assert "\x1b" not in page and "\x00" not in page
    assert "&lt;b&gt;&amp;&lt;/b&gt;" in page  # still escaped once, not twice
