"""JetsamEvent reading on real reports (tests/data/jetsam, sources in its README) and corrupted variants.

Expected values are computed here from the raw JSON loaded with `json` (rpages × pageSize, the header's
OS version and product), not taken from the parser.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrig.exceptions import NotAJetsamReportError, ProcessNotInReportsError, ReportError
from kvrig.reports.jetsam import MAX_REPORT_BYTES, read_report, verdict

DATA = Path(__file__).parent / "data" / "jetsam"
IOS11 = DATA / "JetsamEvent-ios11.4.1-iPhone10-1-excerpt.ips"
IOS14 = DATA / "JetsamEvent-ios14.2-iPhone12-1-excerpt.ips.synced"
IOS15 = DATA / "JetsamEvent-ios15.5-iPhone13-2-excerpt.ips"
IOS16 = DATA / "JetsamEvent-ios16.6-iPhone14-2-excerpt.ips"
IOS18 = DATA / "JetsamEvent-ios18.5-iPhone14-7-excerpt.ips"
IOS18_KILL = DATA / "JetsamEvent-ios18.5-iPhone14-7-kill-excerpt.ips"
REAL = [IOS11, IOS14, IOS15, IOS16, IOS18, IOS18_KILL]
CRASH = DATA / "itunescloudd-ios14.8-crash-bug109-excerpt.ips"
CPU_RESOURCE = DATA / "apfs_defragd.cpu_resource-ios14.2-bug202-excerpt.ips.synced"


def raw(path: Path) -> tuple[dict, dict]:
    header, _, body = path.read_text().partition("\n")
    return json.loads(header), json.loads(body)


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_real_reports_header_and_bytes(path: Path) -> None:
    header, body = raw(path)
    report = read_report(path)
    assert report.os_version == header["os_version"]
    assert report.product == body["product"]
    page = body["memoryStatus"]["pageSize"]
    assert report.page_size == page
    pages = body["memoryStatus"]["memoryPages"]
    assert report.memory.bytes["free"] == pages["free"] * page
    assert report.memory.bytes["wired"] == pages["wired"] * page
    assert report.memory.compressed_bytes == body["memoryStatus"]["compressorSize"] * page
    assert report.largest_process == body.get("largestProcess")
    assert len(report.processes) == len(body["processes"])
    for parsed, source in zip(report.processes, body["processes"], strict=True):
        assert parsed.name == source["name"]
        assert parsed.footprint_bytes == source["rpages"] * page
        assert parsed.lifetime_peak_bytes == source["lifetimeMax"] * page
        assert parsed.states == source["states"]
    killed_names = [p["name"] for p in body["processes"] if "reason" in p]
    assert [p.name for p in report.killed] == killed_names


def test_ios11_per_process_limit_gives_the_limit() -> None:
    _, body = raw(IOS11)
    entry = body["processes"][0]
    report = read_report(IOS11)
    v = verdict(report, "MemoryTest")
    assert v.killed and v.reason == "per-process-limit"
    assert v.footprint_bytes == entry["rpages"] * body["memoryStatus"]["pageSize"]
    # The source blog computes the same number: 16384 * 89600 / 1024 / 1024 = 1400 MB.
    assert v.implied_limit_bytes == 1400 * 2**20
    assert "frontmost" in v.states
    # The excerpt has no largestProcess: a real report with a missing key reads as partial, not an error.
    assert report.partial and any("largestProcess" in p for p in report.problems)


def test_ios14_highwater_kill_in_aging_band_on_old_scale() -> None:
    report = read_report(IOS14)
    assert report.priority_scale == "legacy" and not report.partial
    (killed,) = report.killed
    assert killed.name == "wifianalyticsd" and killed.reason == "highwater"
    assert killed.priority == 1 and killed.priority_band is not None
    assert killed.priority_band.startswith("AGING_BAND1")
    assert killed.implied_limit_bytes is None  # only per-process-limit kills imply the limit


def test_ios15_freeze_skip_reason_key_with_colon() -> None:
    report = read_report(IOS15)
    _, body = raw(IOS15)
    assert report.processes[0].freeze_skip_reason == body["processes"][0]["freeze_skip_reason:"]
    assert report.killed == []


def test_ios18_uses_the_x10_priority_scale() -> None:
    report = read_report(IOS18)
    assert report.priority_scale == "x10"
    by_name = {p.name: p for p in report.processes}
    assert by_name["WidgetRenderer_Default"].priority_band.startswith("FOREGROUND (100)")
    assert by_name["Gmail"].priority_band.startswith("FREEZER (75)")
    assert by_name["wifid"].priority_band.startswith("140: above CONDUCTOR (130)")
    v = verdict(report, "Gmail")
    assert v.present and not v.killed
    assert v.footprint_bytes == 6084 * 16384
    missing = verdict(report, "KvrigSoak")
    assert not missing.present and not missing.killed


def test_ios18_real_per_process_limit_kill_on_the_x10_scale() -> None:
    """The one killed process in the real iOS 18.5 report: an idle daemon over its own limit."""
    header, body = raw(IOS18_KILL)
    page = body["memoryStatus"]["pageSize"]
    (entry,) = [p for p in body["processes"] if "reason" in p]
    report = read_report(IOS18_KILL)
    assert report.os_version == header["os_version"] == "iPhone OS 18.5 (22F76)"
    assert report.product == body["product"] == "iPhone14,7"
    assert report.priority_scale == "x10" and not report.partial
    (killed,) = report.killed
    assert killed.name == entry["name"] == "fileproviderd"
    assert killed.reason == entry["reason"] == "per-process-limit"
    assert killed.pid == entry["pid"] and killed.states == entry["states"]
    assert killed.footprint_bytes == entry["rpages"] * page == 808 * 16384
    # Priority 0 is IDLE on both scales (xnu kern_memorystatus.h): idle daemons go first.
    assert killed.priority == entry["priority"] == 0
    assert killed.priority_band is not None and killed.priority_band.startswith("IDLE (0)")
    # The report's rpages (808) is below the process's lifetime peak (1111 pages): keep both.
    assert killed.lifetime_peak_bytes == entry["lifetimeMax"] * page > killed.footprint_bytes
    v = verdict(report, "fileproviderd")
    assert v.killed and v.reason == "per-process-limit"
    assert v.implied_limit_bytes == entry["rpages"] * page
    # largestProcess is kernel_task; its bytes come from its own entry.
    (kernel,) = [p for p in body["processes"] if p["name"] == body["largestProcess"]]
    assert report.largest_process_bytes == kernel["rpages"] * page
    survivors = [p.name for p in report.processes if not p.killed]
    assert survivors == [p["name"] for p in body["processes"] if "reason" not in p]


def test_ios16_real_report_uses_the_x10_bands() -> None:
    """A real iOS 16.6 report: priorities 10/40/100 are aging, elevated-inactive and foreground."""
    header, body = raw(IOS16)
    report = read_report(IOS16)
    assert report.os_version == header["os_version"] == "iPhone OS 16.6 (20G75)"
    assert report.product == body["product"] == "iPhone14,2"
    assert report.priority_scale == "x10"
    assert report.killed == []
    by_name = {p.name: p for p in report.processes}
    # Band values from xnu kern_memorystatus.h after iOS 16: AGING_BAND1 10, ELEVATED_INACTIVE 40, FOREGROUND 100.
    assert by_name["donotdisturbd"].priority_band.startswith("AGING_BAND1 (10)")
    assert by_name["chronod"].priority_band.startswith("ELEVATED_INACTIVE (40)")
    assert by_name["ThumbnailExtension"].priority_band.startswith("FOREGROUND (100)")
    assert by_name["BTLEServer"].priority_band.startswith("IDLE (0)")
    chronod = next(p for p in body["processes"] if p["name"] == "chronod")
    assert by_name["chronod"].footprint_bytes == chronod["rpages"] * body["memoryStatus"]["pageSize"]
    assert by_name["chronod"].freeze_skip_reason == chronod["freeze_skip_reason:"] == "none"
    # The largest process (WebContent) is not in the excerpt: named, but with no byte count.
    assert report.largest_process == body["largestProcess"] and report.largest_process_bytes is None


def test_same_priority_means_different_bands_before_and_after_ios16(tmp_path: Path) -> None:
    header, body = raw(IOS14)
    body["processes"][0]["priority"] = 10
    old = tmp_path / "old.ips"
    old.write_text(json.dumps(header) + "\n" + json.dumps(body))
    body["build"] = "iPhone OS 16.7 (20H19)"
    new = tmp_path / "new.ips"
    new.write_text(json.dumps(header) + "\n" + json.dumps(body))
    assert read_report(old).processes[0].priority_band.startswith("FOREGROUND (10)")
    assert read_report(new).processes[0].priority_band.startswith("AGING_BAND1 (10)")


@pytest.mark.parametrize("path", [CRASH, CPU_RESOURCE], ids=lambda p: p.name)
def test_other_bug_types_are_named_not_misread(path: Path) -> None:
    header = json.loads(path.read_text().partition("\n")[0])
    with pytest.raises(NotAJetsamReportError) as err:
        read_report(path)
    assert f"bug_type {header['bug_type']}" in str(err.value)
    assert str(path) in str(err.value)
    assert err.value.exit_code == 21


def test_analytics_json_lines_are_not_a_report(tmp_path: Path) -> None:
    path = tmp_path / "Analytics-2025-01-01.ips.ca.synced"
    lines = [{"name": "LogSubmissionSizeV2", "message": {"Count": 1}}, {"name": "other", "sampling": 100.0}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(NotAJetsamReportError, match="bug_type"):
        read_report(path)


def test_single_object_report_is_read(tmp_path: Path) -> None:
    """Some exports hold the whole report as one pretty-printed JSON object with bug_type inside."""
    header, body = raw(IOS14)
    path = tmp_path / "whole.ips"
    path.write_text(json.dumps({**body, "bug_type": header["bug_type"]}, indent=2))
    report = read_report(path)
    assert report.product == body["product"]
    assert [p.name for p in report.killed] == ["wifianalyticsd"]


# --- corrupted variants -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0.55, 0.8, 0.95])
def test_truncated_report_keeps_complete_processes(tmp_path: Path, cut: float) -> None:
    text = IOS18.read_text()
    path = tmp_path / "cut.ips"
    path.write_text(text[: int(len(text) * cut)])
    _, body = raw(IOS18)
    report = read_report(path)
    assert report.partial and any("invalid JSON" in p for p in report.problems)
    assert report.product == body["product"] and report.page_size == 16384
    kept = [p.name for p in report.processes]
    assert kept == [p["name"] for p in body["processes"][: len(kept)]]
    assert len(kept) < len(body["processes"])


def test_a_process_lost_in_a_cut_report_reads_as_unknown_not_as_not_running(tmp_path: Path) -> None:
    _, body = raw(IOS18)
    last = body["processes"][-1]["name"]  # the report's last entry: lost when the file is cut before it
    text = IOS18.read_text()
    path = tmp_path / "cut.ips"
    path.write_text(text[: int(len(text) * 0.8)])
    cut = verdict(read_report(path), last)
    assert not read_report(path).processes_complete
    assert not cut.present and "whether it ran is unknown" in cut.summary and "not running" not in cut.summary
    whole = verdict(read_report(IOS18), "NoSuchProcess")
    assert read_report(IOS18).processes_complete and "it was not running" in whole.summary


def test_negative_or_non_integer_page_counts_are_problems_not_footprints(tmp_path: Path) -> None:
    header, body = raw(IOS18_KILL)
    (killed,) = [p for p in body["processes"] if "reason" in p]
    for value in (-5, 1.5):
        killed["rpages"] = value
        path = tmp_path / "bad.ips"
        path.write_text(json.dumps(header) + "\n" + json.dumps(body))
        report = read_report(path)
        said = verdict(report, killed["name"])
        assert said.footprint_bytes is None and report.partial
        assert said.summary.endswith("at a footprint of unknown (no rpages for it)")  # and no implied limit


def test_truncated_inside_header_line_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "cut.ips"
    path.write_text(IOS18.read_text()[:40])
    with pytest.raises(ReportError) as err:
        read_report(path)
    assert str(path) in str(err.value) and err.value.exit_code in (20, 21)


def test_header_only_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "header.ips"
    path.write_text(IOS18.read_text().partition("\n")[0] + "\n")
    with pytest.raises(ReportError, match="body"):
        read_report(path)


@pytest.mark.parametrize("key", ["memoryStatus", "processes", "product", "largestProcess"])
def test_missing_keys_give_partial_results(tmp_path: Path, key: str) -> None:
    header, body = raw(IOS14)
    del body[key]
    path = tmp_path / "missing.ips"
    path.write_text(json.dumps(header) + "\n" + json.dumps(body))
    report = read_report(path)
    assert report.partial
    assert any(key in p for p in report.problems)


def test_missing_build_falls_back_to_the_header(tmp_path: Path) -> None:
    header, body = raw(IOS14)
    del body["build"]
    path = tmp_path / "nobuild.ips"
    path.write_text(json.dumps(header) + "\n" + json.dumps(body))
    assert read_report(path).os_version == header["os_version"]
    del header["os_version"]
    path.write_text(json.dumps(header) + "\n" + json.dumps(body))
    report = read_report(path)
    assert report.os_version is None and report.priority_scale is None and report.partial
    assert report.killed[0].priority_band is None


def test_missing_page_size_leaves_bytes_unknown(tmp_path: Path) -> None:
    header, body = raw(IOS11)
    del body["memoryStatus"]["pageSize"]
    path = tmp_path / "nopage.ips"
    path.write_text(json.dumps(header) + "\n" + json.dumps(body))
    report = read_report(path)
    assert report.page_size is None and report.partial
    assert report.killed[0].rpages == body["processes"][0]["rpages"]
    assert report.killed[0].footprint_bytes is None


def test_page_size_4096_on_old_devices(tmp_path: Path) -> None:
    header, body = raw(IOS11)
    body["memoryStatus"]["pageSize"] = 4096
    path = tmp_path / "4k.ips"
    path.write_text(json.dumps(header) + "\n" + json.dumps(body))
    assert read_report(path).killed[0].footprint_bytes == body["processes"][0]["rpages"] * 4096


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["processes"][1].__setitem__("rpages", "382"), "rpages"),
        (lambda b: b["processes"][1].__setitem__("states", "daemon"), "states"),
        (lambda b: b["memoryStatus"].__setitem__("pageSize", "16384"), "pageSize"),
        (lambda b: b.__setitem__("processes", {"a": 1}), "processes"),
        (lambda b: b["processes"].__setitem__(0, [1, 2]), "processes[0]"),
        (lambda b: b.__setitem__("memoryStatus", 7), "memoryStatus"),
        (lambda b: b["processes"][1].__setitem__("priority", True), "priority"),
    ],
)
def test_wrong_types_give_partial_results(tmp_path: Path, mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    header, body = raw(IOS14)
    mutate(body)
    path = tmp_path / "types.ips"
    path.write_text(json.dumps(header) + "\n" + json.dumps(body))
    report = read_report(path)
    assert report.partial and any(field in p for p in report.problems)


def test_body_that_is_not_an_object(tmp_path: Path) -> None:
    header, _ = raw(IOS14)
    path = tmp_path / "list.ips"
    path.write_text(json.dumps(header) + "\n[1, 2, 3]")
    with pytest.raises(ReportError, match="not an object"):
        read_report(path)


def test_binary_and_empty_files(tmp_path: Path) -> None:
    binary = tmp_path / "x.ips"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    empty = tmp_path / "e.ips"
    empty.write_bytes(b"")
    for path in (binary, empty):
        with pytest.raises(NotAJetsamReportError):
            read_report(path)
    with pytest.raises(ReportError, match="not found"):
        read_report(tmp_path / "absent.ips")


def test_too_large_file_is_refused_without_reading(tmp_path: Path) -> None:
    path = tmp_path / "huge.ips"
    with path.open("wb") as f:  # sparse: costs no disk and no time
        f.truncate(MAX_REPORT_BYTES + 1)
    with pytest.raises(ReportError, match="too large"):
        read_report(path)


def test_large_valid_report_is_read(tmp_path: Path) -> None:
    header, body = raw(IOS18)
    template = body["processes"][4]
    body["processes"] = [{**template, "pid": i, "rpages": i} for i in range(20_000)]
    body["processes"].append({**template, "name": "KvrigSoak", "rpages": 123_456, "reason": "per-process-limit"})
    path = tmp_path / "big.ips"
    path.write_text(json.dumps(header) + "\n" + json.dumps(body, indent=2))
    assert path.stat().st_size > 5_000_000
    report = read_report(path)
    assert len(report.processes) == 20_001
    assert verdict(report, "KvrigSoak").implied_limit_bytes == 123_456 * 16384


# --- property-based: random JSON shapes never raise anything but our errors ----------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
body_like = st.fixed_dictionaries(
    {},
    optional={
        "build": json_values | st.just("iPhone OS 17.2 (21C62)"),
        "product": json_values,
        "memoryStatus": json_values
        | st.fixed_dictionaries({}, optional={"pageSize": json_values, "memoryPages": json_values}),
        "largestProcess": json_values,
        "processes": json_values
        | st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    k: json_values for k in ("name", "pid", "rpages", "reason", "states", "priority", "lifetimeMax")
                },
            ),
            max_size=5,
        ),
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=json_values | st.just({"bug_type": "298"}), body=json_values | body_like, cut=st.integers(0, 400))
def test_fuzz_random_json_shapes(tmp_path: Path, header: object, body: object, cut: int) -> None:
    path = tmp_path / "fuzz.ips"
    text = json.dumps(header) + "\n" + json.dumps(body)
    path.write_text(text if cut == 0 else text[: max(1, len(text) - cut)])
    try:
        report = read_report(path)
    except ReportError as exc:
        assert str(path) in str(exc)
        return
    assert report.bug_type == "298"
    for p in report.processes:
        if p.footprint_bytes is not None:
            assert p.rpages is not None and report.page_size is not None
            assert p.footprint_bytes == p.rpages * report.page_size


# --- the command ---------------------------------------------------------------------------------------


def run_kvrig(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True)


def test_cli_json_lists_reports_and_fails_at_the_end_for_bad_files() -> None:
    proc = run_kvrig("jetsam", str(IOS11), str(CRASH), str(IOS18), "--process", "MemoryTest", "--json")
    assert proc.returncode == 21, proc.stderr
    assert "Traceback" not in proc.stderr
    out = json.loads(proc.stdout)
    assert [e["file"] for e in out] == [str(IOS11), str(CRASH), str(IOS18)]
    first = out[0]
    for key in ("file", "os_version", "product", "page_size", "largest_process", "killed"):
        assert key in first
    (killed,) = first["killed"]
    for key in ("name", "pid", "reason", "rpages", "footprint_bytes", "states", "priority"):
        assert key in killed
    assert killed["footprint_bytes"] == 89600 * 16384
    assert first["verdict"]["killed"] is True
    assert "bug_type 109" in out[1]["error"]
    assert out[2]["verdict"]["present"] is False


def test_cli_table_and_exit_code_for_good_reports() -> None:
    proc = run_kvrig("jetsam", str(IOS14))
    assert proc.returncode == 0, proc.stderr
    assert "wifianalyticsd" in proc.stdout and "highwater" in proc.stdout


def test_a_bundle_id_is_answered_with_the_processes_that_could_be_the_app() -> None:
    """Reports name processes by executable, never by bundle id: `--process com.example.app` names the killed
    and frontmost processes of the real reports (read from their JSON) instead of a bare 'not in this report'."""
    _, killed_body = raw(IOS18_KILL)
    v = verdict(read_report(IOS18_KILL), "dev.kvrig.demo")
    assert not v.present and not v.killed
    assert v.candidates == [p["name"] for p in killed_body["processes"] if "reason" in p] == ["fileproviderd"]
    assert "bundle id" in v.summary and "fileproviderd" in v.summary
    _, body = raw(IOS18)
    v = verdict(read_report(IOS18), "dev.kvrig.demo")
    assert v.candidates == [p["name"] for p in body["processes"] if "frontmost" in p["states"]]
    # a plain name that is absent is told apart from a bundle id
    assert "bundle id" not in verdict(read_report(IOS18), "SmolLM2Demo").summary
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "jetsam", str(IOS18_KILL), "--process", "dev.kvrig.demo", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == ProcessNotInReportsError.exit_code, proc.stderr
    assert json.loads(proc.stdout)[0]["verdict"]["candidates"] == ["fileproviderd"]


def test_a_process_in_no_report_is_no_clean_exit() -> None:
    """A name in none of the reports gets its own exit after every report is printed; one report that has it is
    enough for 0, killed or not."""
    absent = run_kvrig("jetsam", str(IOS11), str(IOS18), "--process", "SmolLM2Demo")
    assert absent.returncode == ProcessNotInReportsError.exit_code, absent.stderr
    assert "SmolLM2Demo" in absent.stderr and "Traceback" not in absent.stderr
    assert str(IOS11) in absent.stdout and str(IOS18) in absent.stdout
    killed_in_one = run_kvrig("jetsam", str(IOS11), str(IOS18), "--process", "MemoryTest", "--json")
    assert killed_in_one.returncode == 0, killed_in_one.stderr
    assert [e["verdict"]["present"] for e in json.loads(killed_in_one.stdout)] == [True, False]
