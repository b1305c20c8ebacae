"""Telemetry JSONL: runs, torn last line, skipped lines, summaries, and correlation with a real jetsam report.

Records are written with the contract models (kvrig.schemas.telemetry); expected numbers are computed
here from the lists written, and from the real report's raw JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrig.exceptions import ReportError
from kvrig.reports.jetsam import read_report
from kvrig.reports.telemetry import correlate, read_telemetry, summarize, summarize_run
from kvrig.schemas.telemetry import EndEvent, MemoryPressureEvent, StartEvent, StepEvent

REPORT = Path(__file__).parent / "data" / "jetsam" / "JetsamEvent-ios11.4.1-iPhone10-1-excerpt.ips"
T0 = datetime.strptime("2020-01-03 04:10:00.00 +0800", "%Y-%m-%d %H:%M:%S.%f %z").timestamp()
MIB = 2**20


def run_records(run_id: str, contexts: list[int], *, end: bool, t0: float = T0) -> list[str]:
    recs = [
        StartEvent(
            run_id=run_id,
            seq=0,
            t=t0,
            model="smollm2-135m",
            scheme="k8v4",
            product_type="iPhone10,1",
            os_version="iPhone OS 11.4.1",
            limit_bytes=1400 * MIB,
        )
    ]
    for i, ctx in enumerate(contexts, start=1):
        recs.append(
            StepEvent(
                run_id=run_id,
                seq=i,
                t=t0 + i,
                context_tokens=ctx,
                decode_tps=100.0 - i,
                phys_footprint_bytes=500 * MIB + ctx * 1024,
            )
        )
    recs.append(
        MemoryPressureEvent(
            run_id=run_id, seq=len(recs), t=t0 + len(recs), level="warning", context_tokens=contexts[-1]
        )
    )
    if end:
        recs.append(
            EndEvent(
                run_id=run_id,
                seq=len(recs),
                t=t0 + len(recs),
                reason="completed",
                context_tokens=contexts[-1],
            )
        )
    return [r.model_dump_json(by_alias=True) for r in recs]


@pytest.mark.parametrize("tail", ["this is not telemetry", '{"event": "step"} and more', "\x00\x01ELF"])
def test_a_last_line_that_is_no_record_cut_short_is_skipped_not_torn(tmp_path: Path, tail: str) -> None:
    """Only an object cut short is a write the app was killed in; other text on the last line is not the app's."""
    lines = run_records("r1", [256, 512], end=False)
    path = tmp_path / "telemetry.jsonl"
    path.write_text("\n".join(lines) + "\n" + tail)
    log = read_telemetry(path)
    assert log.torn_line is None and log.partial
    assert [s.line for s in log.skipped] == [len(lines) + 1]
    alone = tmp_path / "alone.jsonl"
    alone.write_text(tail)
    with pytest.raises(ReportError) as caught:
        read_telemetry(alone)
    assert "torn" not in str(caught.value) and "line 1: not JSON" in str(caught.value)


def test_torn_last_line_is_tolerated_and_reported(tmp_path: Path) -> None:
    contexts = [256, 512, 1024, 2048, 4096]
    lines = run_records("r1", contexts, end=False)
    path = tmp_path / "telemetry.jsonl"
    path.write_text("\n".join(lines) + "\n" + lines[1][:37])  # killed mid-write: no newline, half a record
    log = read_telemetry(path)
    assert log.torn_line == len(lines) + 1 and log.skipped == [] and not log.partial
    (run,) = log.runs
    s = summarize_run(run)
    assert s.max_context_tokens == max(contexts) and s.steps == len(contexts)
    assert s.max_footprint_bytes == 500 * MIB + max(contexts) * 1024
    assert s.end_reason is None  # no end record: the run did not finish
    assert s.memory_pressure == {"warning": 1}
    assert (1024, 100.0 - 3) in s.tps_at_context and s.tps_at_context[-1] == (4096, 100.0 - 5)
    assert s.footprint_curve[0] == (256, 500 * MIB + 256 * 1024)


def test_tok_s_is_labelled_with_the_context_its_step_measured(tmp_path: Path) -> None:
    """Steps at 260, 520, ... tokens: no row claims 512 or 1024, each row is a step's own context and speed."""
    contexts = [260 * (i + 1) for i in range(6)]
    path = tmp_path / "telemetry.jsonl"
    path.write_text("\n".join(run_records("r1", contexts, end=True)) + "\n")
    (run,) = read_telemetry(path).runs
    measured = {c: 100.0 - i for i, c in enumerate(contexts, start=1)}  # what run_records writes
    rows = summarize_run(run).tps_at_context
    assert rows and all(measured[c] == tps for c, tps in rows)
    assert [c for c, _ in rows] == [260, 780, 1560]  # the last at or below 512, 1024 and 2048 (the last step)


def test_report_without_process_and_without_results_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(run_records("r1", [64, 128], end=False)) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "telemetry", str(path), "--report", str(REPORT)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 3 and "--process" in proc.stderr and str(path) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_lines_in_the_middle_are_skipped_with_their_numbers(tmp_path: Path) -> None:
    lines = run_records("r1", [100, 200, 300], end=True)
    bad = json.loads(lines[2])
    bad["phys_footprint_bytes"] = "lots"
    lines[2] = json.dumps(bad)
    lines.insert(3, "{not json")
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    log = read_telemetry(path)
    assert [s.line for s in log.skipped] == [3, 4] and log.partial
    assert "phys_footprint_bytes" in log.skipped[0].reason
    assert log.torn_line is None
    assert summarize(log)[0][0].steps == 2


def test_two_runs_in_one_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(run_records("a", [10, 20], end=True) + run_records("b", [30, 40, 50], end=True)))
    summaries = {s.run_id: s for s, _ in summarize(read_telemetry(path))}
    assert summaries["a"].max_context_tokens == 20 and summaries["b"].max_context_tokens == 50
    assert summaries["a"].end_reason == "completed"


@pytest.mark.parametrize("content", [b"", b"\n\n", b"garbage\n", b"\xff\xfe\n", b'{"event": "nope"}\n'])
def test_nothing_usable_is_a_clear_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    with pytest.raises(ReportError) as err:
        read_telemetry(path)
    assert str(path) in str(err.value) and err.value.exit_code == 20


def test_correlate_with_a_real_report(tmp_path: Path) -> None:
    contexts = [1000, 2000, 3000]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(run_records("r1", contexts, end=False)) + "\n")
    (run,) = read_telemetry(path).runs
    report = read_report(REPORT)
    body = json.loads(REPORT.read_text().partition("\n")[2])
    killed = body["processes"][0]
    report_bytes = killed["rpages"] * body["memoryStatus"]["pageSize"]
    corr = correlate(run, report, process=killed["name"])
    last_fp = 500 * MIB + contexts[-1] * 1024
    assert corr.killed and corr.reason == "per-process-limit"
    assert corr.last_context_tokens == contexts[-1] and corr.last_footprint_bytes == last_fp
    assert corr.report_footprint_bytes == report_bytes
    assert corr.gap_bytes == report_bytes - last_fp
    assert corr.implied_limit_bytes == report_bytes and corr.app_limit_bytes == 1400 * MIB
    report_t = datetime.strptime(body["date"], "%Y-%m-%d %H:%M:%S.%f %z").timestamp()
    last_t = T0 + len(contexts) + 1  # the memory-pressure record is the last one written
    assert corr.gap_seconds == pytest.approx(report_t - last_t, abs=0.01)
    other = correlate(run, report, process="SomeOtherApp")
    assert not other.killed and other.gap_bytes is None


def test_cli_telemetry_json_with_report(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(run_records("r1", [64, 128], end=False)) + '\n{"schema": 1, "run_')
    missing = tmp_path / "absent.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvrig",
            "telemetry",
            str(path),
            str(missing),
            "--report",
            str(REPORT),
            "--process",
            "MemoryTest",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 20 and "Traceback" not in proc.stderr
    out = json.loads(proc.stdout)
    assert out[0]["run_id"] == "r1" and out[0]["torn_line"] == 5 and out[0]["max_context_tokens"] == 128
    assert out[0]["correlation"]["killed"] is True
    assert "not found" in out[1]["error"]


json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6)
records = st.dictionaries(
    st.sampled_from(["schema", "run_id", "seq", "t", "event", "context_tokens", "phys_footprint_bytes", "x"]),
    json_scalars | st.sampled_from(["step", "start", "end", "r1"]),
    max_size=7,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(records, max_size=6), tail=st.text(max_size=10))
def test_fuzz_random_lines(tmp_path: Path, lines: list[dict], tail: str) -> None:
    path = tmp_path / "fuzz.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + tail)
    try:
        log = read_telemetry(path)
    except ReportError as exc:
        assert str(path) in str(exc)
        return
    # Whatever was kept comes from the lines written: a run's steps are some of its step lines, in their order.
    written = [x for x in lines if isinstance(x.get("run_id"), str)]
    assert sum(len(r.events) for r in log.runs) + log.skipped_lines <= len(lines) + tail.count("\n") + 1
    for s, _ in summarize(log):
        step_lines = [x for x in written if x["run_id"] == s.run_id and x.get("event") == "step"]
        assert any(x["run_id"] == s.run_id for x in written)
        assert s.steps <= len(step_lines)
        if s.steps:
            assert s.last_context_tokens in [x.get("context_tokens") for x in step_lines]
            assert s.max_context_tokens is not None and s.max_context_tokens >= s.last_context_tokens


def test_records_with_nan_or_infinity_are_skipped_not_summarised(tmp_path: Path) -> None:
    """JSON has no NaN or Infinity; Python's reader takes them, so such a record is refused by the schema (a summary
    carrying one would print JSON that strict readers refuse)."""
    lines = run_records("r1", [256, 512], end=False)
    bad = json.loads(lines[1]) | {"decode_tps": "NaN"}
    text = "\n".join([lines[0], json.dumps(bad).replace('"NaN"', "NaN"), lines[2]]) + "\n"
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    log = read_telemetry(path)
    assert [s.line for s in log.skipped] == [2] and "finite number" in log.skipped[0].reason
    assert summarize_run(log.runs[0]).steps == 1


def test_a_record_with_a_lone_surrogate_is_skipped_not_carried(tmp_path: Path) -> None:
    """JSON's "\\ud83d" escape parses to a lone surrogate no UTF-8 writer can put back: carried into a result it made
    results.json (pydantic) and junit.xml refuse to be written. A surrogate pair is a character, and stays."""
    lines = run_records("r1", [256], end=True)
    end = json.loads(lines[-1])
    torn = json.dumps(end | {"reason": "error", "message": "X"}).replace('"X"', '"bad \\ud83d"')
    whole = json.dumps(end | {"reason": "error", "message": "X"}).replace('"X"', '"ok \\ud83d\\ude00"')
    for text, kept in ((torn, False), (whole, True)):
        path = tmp_path / "t.jsonl"
        path.write_text("\n".join([*lines[:-1], text]) + "\n")
        log = read_telemetry(path)
        assert (log.runs[0].end is not None) is kept
        if kept:
            assert log.runs[0].end is not None and log.runs[0].end.message == "ok \U0001f600"
        else:
            assert "lone surrogate" in log.skipped[0].reason and "'message'" in log.skipped[0].reason
