"""A phone that lies about its files (defects 1, 3, 8, 11 of issue 24): sizes it claims, reads that never end
or stall, report entries that are directories or gone, report names too long or differing only in case. Every
read from the phone keeps its size cap and its deadline; a bad report entry costs only itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from kvrig.device import crash
from kvrig.reports.jetsam import MAX_REPORT_BYTES
from kvrig.schemas import load_model_file
from kvrig.schemas.results import ResultsFile
from kvrig.soaking.driver import SoakOptions, run_soak
from kvrig.soaking.plan import make_plan
from kvrig.virtual.faults import FaultPlan
from tests.hostile.conftest import BUNDLE_ID, ROOT, Emulator, kvrig, lying, on_device, run
from tests.hostile_suite import hostile
from tests.raw_telemetry import raw_steps

__all__ = ["lying"]
TELEMETRY_CAP = 16 * 1024 * 1024  # the soak's cap on a telemetry file, as docs/hostile.md gives it
SOAK = ["soak", "--app-id", BUNDLE_ID, "--step-tokens", "256", "--decode-tokens", "1", "--battery-interval", "60"]


def _soak(emulator: Emulator, out: Path, *args: str) -> tuple[int, str, float, ResultsFile]:
    ran = kvrig(*SOAK, "--udid", emulator.udid, "-o", str(out), *args, timeout=240)
    assert "Traceback" not in ran.stderr, ran.stderr
    return ran.code, ran.stderr, ran.seconds, load_model_file(ResultsFile, out / "results.json")


@hostile(1, "telemetry the phone says is 2^50 bytes", "soak --timeout 45 --hang-after 10: exit 19 within 60 s")
def test_a_telemetry_file_claimed_huge_ends_the_soak_in_time(lying: Emulator, tmp_path: Path) -> None:
    lying.device.faults = FaultPlan(claim_sizes={"telemetry.jsonl": 2**50})
    code, stderr, seconds, saved = _soak(lying, tmp_path / "out", "--timeout", "45", "--hang-after", "10")
    assert code == 19, stderr
    assert seconds < 60
    assert "telemetry.jsonl" in stderr and str(2**50) in stderr
    assert saved.runs[0].error is not None and saved.runs[0].error.startswith("watch: ")
    assert lying.device.apps.pid_for_bundle(BUNDLE_ID) == 0  # the soak stopped the app it launched


@hostile(1, "telemetry whose reads never end", "exit 19 after 16 MiB, within 60 s")
def test_endless_telemetry_reads_stop_at_the_cap(lying: Emulator, tmp_path: Path) -> None:
    lying.device.faults = FaultPlan(endless_reads=["telemetry.jsonl"])
    code, stderr, seconds, _ = _soak(lying, tmp_path / "out", "--timeout", "45", "--hang-after", "10")
    assert code == 19, stderr
    assert seconds < 60
    assert f"more than {TELEMETRY_CAP} bytes" in stderr
    assert (tmp_path / "out" / "telemetry.jsonl").stat().st_size <= TELEMETRY_CAP
    assert lying.device.apps.pid_for_bundle(BUNDLE_ID) == 0


@hostile(1, "telemetry reads that stall 600 s each", "the read's deadline (--hang-after 10): exit 19 within 60 s")
def test_a_stalled_read_keeps_its_deadline(lying: Emulator, tmp_path: Path) -> None:
    lying.device.faults = FaultPlan(slow_reads={"telemetry.jsonl": 600.0})
    code, stderr, seconds, _ = _soak(lying, tmp_path / "out", "--timeout", "45", "--hang-after", "10")
    assert code == 19, stderr
    assert seconds < 60
    assert "not read within 10 s" in stderr
    assert lying.device.apps.pid_for_bundle(BUNDLE_ID) == 0


@hostile(
    3, "a 2 GiB JetsamEvent report", f"refused by its size before a byte is read (cap {MAX_REPORT_BYTES >> 20} MiB)"
)
def test_a_huge_report_is_skipped_before_reading(lying: Emulator, tmp_path: Path) -> None:
    huge = lying.device.state.crash / "JetsamEvent-2026-03-01-000000.ips"
    with huge.open("wb") as f:
        f.truncate(2 * 1024**3)  # sparse: costs no disk
    afc_bytes = lying.device.afc_bytes
    pulled = run(on_device(lying.udid, lambda d: crash.pull_reports(d, [f"/{huge.name}"], tmp_path / "out")))
    assert pulled.pulled == [] and len(pulled.skipped) == 1
    assert str(2 * 1024**3) in pulled.skipped[0] and "kvrig reads at most" in pulled.skipped[0]
    assert list((tmp_path / "out").iterdir()) == []  # no partial file left behind
    assert lying.device.afc_bytes - afc_bytes < 1 << 20  # requests and stat replies, no content


@hostile(3, "a 40 MiB report pulled", "streamed in 1 MiB reads: peak Python memory under 12 MiB")
def test_reports_are_streamed_not_held(lying: Emulator, tmp_path: Path) -> None:
    big = lying.device.state.crash / "JetsamEvent-2026-03-02-000000.ips"
    big.write_bytes(b'{"bug_type":"298"}\n' + b"z" * (40 * 1024**2))
    tracemalloc.start()
    try:
        pulled = run(on_device(lying.udid, lambda d: crash.pull_reports(d, [f"/{big.name}"], tmp_path / "out")))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (local,) = pulled.pulled
    assert local.stat().st_size == big.stat().st_size
    assert peak < 12 * 1024**2, f"peak {peak / 2**20:.1f} MiB"


@hostile(3, "telemetry of 10 million one-character bad lines", "read in under 30 s and 300 MB; 20 lines listed")
def test_ten_million_bad_lines_cost_neither_memory_nor_minutes(tmp_path: Path) -> None:
    bad = tmp_path / "telemetry.jsonl"
    with bad.open("wb") as f:
        for _ in range(10):
            f.write(b"x\n" * 1_000_000)
    record = {"schema": 3, "run_id": "r", "seq": 0, "t": 1.0, "event": "step", "context_tokens": 256}
    with bad.open("ab") as f:
        f.write(json.dumps({**record, "phys_footprint_bytes": 1}).encode() + b"\n")
    code = (
        "import json, sys, time\n"
        "from kvrig.reports.telemetry import read_telemetry\n"
        "t = time.monotonic(); log = read_telemetry(sys.argv[1]); t = time.monotonic() - t\n"
        # VmHWM is this process's own peak; ru_maxrss keeps the peak of the (large) pytest process it came from
        "hwm = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
        "print(json.dumps({'s': t, 'rss_kb': hwm,\n"
        "  'listed': len(log.skipped), 'skipped': log.skipped_lines, 'steps': len(log.runs[0].steps)}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["skipped"] == 10_000_000 and seen["listed"] == 20 and seen["steps"] == 1
    assert seen["s"] < 30 and seen["rss_kb"] < 300 * 1024


@hostile(
    8,
    "a directory, a vanished entry and a 2^50-byte claim named JetsamEvent-*.ips",
    "outcome jetsam; each bad entry skipped with why",
)
def test_unreadable_report_entries_do_not_lose_the_jetsam_result(lying: Emulator, tmp_path: Path) -> None:
    store = lying.device.state.crash

    def entries_appear_once_the_app_runs() -> None:  # new since the soak's first listing, as a kill's report is
        deadline = time.monotonic() + 60
        while not lying.device.apps.pid_for_bundle(BUNDLE_ID) and time.monotonic() < deadline:
            time.sleep(0.05)
        (store / "JetsamEvent-x.ips").mkdir()
        (store / "JetsamEvent-liar.ips").write_text("{}")
        lying.device.faults = FaultPlan(
            phantom_entries=["JetsamEvent-rotated-away.ips"], claim_sizes={"JetsamEvent-liar.ips": 2**50}
        )

    hostile_store = threading.Thread(target=entries_appear_once_the_app_runs)
    hostile_store.start()
    plan = make_plan(max_tokens=1_000_000, step_tokens=512, decode_tokens=1, scheme="fp16")
    options = SoakOptions(poll_interval_s=0.2, hang_after_s=30, report_wait_s=10, battery_interval_s=None)
    result = run(on_device(lying.udid, lambda d: run_soak(d, BUNDLE_ID, plan, tmp_path, options)))
    hostile_store.join()
    assert result.outcome == "jetsam", (result.outcome_detail, result.error, result.files)
    assert result.footprint_at_kill_bytes is not None
    skipped = "\n".join(result.files.skipped_reports)
    assert "/JetsamEvent-x.ips: " in skipped and "not a regular file" in skipped
    assert "/JetsamEvent-rotated-away.ips: " in skipped and "gone" in skipped
    assert "/JetsamEvent-liar.ips: " in skipped and str(2**50) in skipped
    (report,) = result.files.jetsam_reports  # the real one, pulled beside the bad entries
    assert (tmp_path / report).read_bytes() == (store / Path(report).name).read_bytes()


@hostile(11, "report names of 248 bytes, and names that differ only in case", "each its own file, ending .ips")
def test_long_and_case_only_names_stay_distinct_reports(lying: Emulator, tmp_path: Path) -> None:
    store = lying.device.state.crash
    if _ignores_case(store):
        pytest.skip(f"{store}'s file system ignores case (macOS's does): the phone's names cannot differ only in it")
    names = [
        "JetsamEvent-" + "a" * 230 + "-1.ips",
        "JetsamEvent-" + "a" * 230 + "-2.ips",
        "JetsamEvent-Case.ips",
        "JetsamEvent-CASE.ips",
        "JetsamEvent-case.ips",
    ]
    for i, name in enumerate(names):
        (store / name).write_text(str(i))
    pulled = run(on_device(lying.udid, lambda d: crash.pull_reports(d, [f"/{n}" for n in names], tmp_path))).pulled
    assert len(pulled) == len(names)
    assert all(p.name.endswith(".ips") and len(p.name.encode()) <= 255 for p in pulled)
    assert len({p.name.casefold() for p in pulled}) == len(names)  # distinct on a case-insensitive disk too
    assert sorted(p.read_text() for p in pulled) == [str(i) for i in range(len(names))]


@hostile(5, "kvrig soak SIGTERMed while its app hangs", "exit 143 within 20 s; the app stopped; results say so")
def test_a_terminated_soak_stops_its_app(lying: Emulator, tmp_path: Path) -> None:
    lying.device.faults = FaultPlan(hang_at_tokens=512)
    out = tmp_path / "out"
    env = {**os.environ, "USBMUXD_SOCKET_ADDRESS": lying.address}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrig", *SOAK, "--udid", lying.udid, "--hang-after", "600", "-o", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (out / "telemetry.jsonl").exists() or not raw_steps(out / "telemetry.jsonl"):  # mid-soak
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    assert lying.device.apps.pid_for_bundle(BUNDLE_ID) != 0
    start = time.monotonic()
    proc.terminate()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert time.monotonic() - start < 20 and "Traceback" not in stderr
    assert lying.device.apps.pid_for_bundle(BUNDLE_ID) == 0
    (run_result,) = load_model_file(ResultsFile, out / "results.json").runs
    assert run_result.error is not None and "interrupted" in run_result.error
    assert "the app was stopped" in run_result.error  # said only once the phone no longer runs it


def _ignores_case(folder: Path) -> bool:
    probe = folder / "kvrig-Case-Probe"
    probe.write_text("")
    try:
        return (folder / "kvrig-case-probe").exists()
    finally:
        probe.unlink()
