"""A lab interrupted, pointed at a used folder, out of disk, or beside a malformed phone (defects 4, 5, 6, 10 of
issue 24), on the lab's two virtual iPhones, `kvrig lab run` started as a user starts it. Workers die with their
parent and stop their apps; a second run never overwrites the first; a write that fails is exit 38 with nothing
half-written; a malformed phone is that phone's outcome."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrig.lab.model import RUNS_DIR
from kvrig.schemas import load_model_file
from kvrig.schemas.results import ResultsFile
from kvrig.virtual.faults import FaultPlan
from tests.hostile.conftest import ROOT, kvrig
from tests.hostile_suite import hostile
from tests.lab.conftest import BUNDLE_ID, FAST, Phones, phones, short_entry

__all__ = ["phones"]
LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads processes from Linux's /proc")
STOPPED_WITHIN_S = 25  # the workers' STOP_S (15 s) and a loaded machine's margin


def _lab(path: Path, entry: dict[str, Any], **timeouts: float) -> Path:
    lab = {
        "schema": 1,
        "timeouts": {**FAST, **timeouts},
        "devices": [{"udid": "any"}],
        "matrix": [entry],
        "threshold": {"confirm_runs": 0},
    }
    path.write_text(yaml.safe_dump(lab, sort_keys=False))
    return path


# As a terminal starts a command in the foreground: SIGINT at its default, whatever this test process inherited (a
# suite run as a shell's background job ignores SIGINT, and so would every child it starts); exec keeps the pid.
FOREGROUND = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, '-m', 'kvrig', *sys.argv[1:]])"
)


def _start(phones: Phones, lab: Path, out: Path, **popen: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "USBMUXD_SOCKET_ADDRESS": phones.address}
    return subprocess.Popen(
        [sys.executable, "-c", FOREGROUND, "lab", "run", str(lab), "-o", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _signal_state(pid: int) -> dict[str, str]:
    """The kernel's view of a process's signals (hex masks: blocked, ignored, caught, pending) and what each of its
    threads waits in: what a lab that does not stop on SIGINT was doing, for the failure message."""
    state = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd"):
                state[key] = value.strip()
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                state[f"thread {task.name}"] = (task / "wchan").read_text()
    return state


def _catches(pid: int, signum: int) -> bool:
    state = _signal_state(pid)
    return bool(int(state.get("SigCgt", "0"), 16) >> (signum - 1) & 1) and not (
        int(state.get("SigBlk", "0"), 16) >> (signum - 1) & 1
    )


def _interrupted(proc: subprocess.Popen[str], send: Callable[[], None]) -> str:
    """Sends SIGINT (through `send`) to a lab that catches it; its stderr once it has ended."""
    assert _catches(proc.pid, signal.SIGINT), f"the lab cannot see SIGINT: {_signal_state(proc.pid)}"
    send()
    try:
        return proc.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:
        state = _signal_state(proc.pid)
        proc.kill()
        raise AssertionError(f"the lab did not end 120 s after SIGINT; its signals and threads then: {state}") from None


def _children(parent: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.add(int(stat.parent.name))
    return found


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (R, S, T for stopped, Z), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _apps(phones: Phones) -> list[int]:
    return [device.apps.pid_for_bundle(BUNDLE_ID) for device in (phones.pro15, phones.pro13)]


def _errors(out: Path) -> list[str | None]:
    """What each run's own results.json says happened (a worker writes it as it stops)."""
    return [r.error for f in (out / RUNS_DIR).rglob("results.json") for r in load_model_file(ResultsFile, f).runs]


def _wait(condition, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())


@pytest.fixture()
def hung(phones: Phones) -> Iterator[Phones]:
    """Both phones' apps stop (alive, silent) at 512 tokens, so a lab is mid-soak for as long as a test needs."""
    for device in (phones.pro15, phones.pro13):
        device.faults = FaultPlan(hang_at_tokens=512)
    yield phones
    for device in (phones.pro15, phones.pro13):
        device.faults = FaultPlan()
        phones.host.run(device.apps.kill_all())


def _mid_soak(phones: Phones, tmp_path: Path, **popen: Any) -> tuple[subprocess.Popen[str], set[int], Path]:
    """A lab started and waited for until both apps hang mid-soak; the process, its workers, its folder."""
    entry = short_entry(soak={"step_tokens": 256, "max_tokens": 1_000_000, "decode_tokens": 1})
    lab = _lab(tmp_path / "lab.yaml", entry, hang_after_s=600)
    out = tmp_path / "out"
    proc = _start(phones, lab, out, **popen)
    assert _wait(lambda: all(_apps(phones)) or proc.poll() is not None, 120), "the apps never started"
    assert proc.poll() is None, proc.communicate()
    # Both at their hang (the fault SIGSTOPs the app: state T), alive, and the lab waiting on them; seen, not slept.
    assert _wait(lambda: all(_state(pid) == "T" for pid in _apps(phones)) or proc.poll() is not None, 60), _apps(phones)
    workers = _children(proc.pid)
    assert len(_alive(workers)) >= 2, workers
    return proc, workers, out


@LINUX_PROC
@hostile(5, "kvrig lab run SIGKILLed mid-soak", f"workers gone and apps stopped within {STOPPED_WITHIN_S} s")
def test_workers_die_with_their_parent_and_stop_their_apps(hung: Phones, tmp_path: Path) -> None:
    proc, workers, out = _mid_soak(hung, tmp_path)
    proc.kill()
    proc.communicate()
    assert _wait(lambda: not _alive(workers), STOPPED_WITHIN_S), f"orphans: {_alive(workers)}"
    assert _wait(lambda: not any(_apps(hung)), 5), f"apps still running: {_apps(hung)}; the runs say {_errors(out)}"
    assert all(e is not None and "the app was stopped" in e for e in _errors(out)), _errors(out)
    written = {p: p.stat().st_mtime_ns for p in (out / RUNS_DIR).rglob("*") if p.is_file()}
    time.sleep(2)
    assert {p: p.stat().st_mtime_ns for p in (out / RUNS_DIR).rglob("*") if p.is_file()} == written


@LINUX_PROC
@hostile(
    5, "Ctrl-C in the terminal mid-soak (SIGINT to the group)", f"exit 130, apps stopped within {STOPPED_WITHIN_S} s"
)
def test_ctrl_c_stops_every_app_and_saves_what_it_learned(hung: Phones, tmp_path: Path) -> None:
    proc, workers, out = _mid_soak(hung, tmp_path, start_new_session=True)
    start = time.monotonic()
    stderr = _interrupted(proc, lambda: os.killpg(proc.pid, signal.SIGINT))
    assert proc.returncode == 130, stderr
    assert time.monotonic() - start < STOPPED_WITHIN_S
    assert "Traceback" not in stderr
    assert not any(_apps(hung))
    # multiprocessing's resource tracker, a child too, ends once it reads its parent's end of the pipe close
    assert _wait(lambda: not _alive(workers), 10), f"left behind: {_alive(workers)}"
    runs = load_model_file(ResultsFile, out / "results.json").runs
    assert len(runs) == 2 and all(r.error and "interrupted" in r.error for r in runs), [r.error for r in runs]


@LINUX_PROC
@hostile(5, "SIGINT to the lab's parent process alone", f"exit 130 within {STOPPED_WITHIN_S} s, apps stopped")
def test_sigint_to_the_parent_alone_stops_the_lab_quickly(hung: Phones, tmp_path: Path) -> None:
    proc, workers, _ = _mid_soak(hung, tmp_path)
    start = time.monotonic()
    stderr = _interrupted(proc, lambda: proc.send_signal(signal.SIGINT))
    assert proc.returncode == 130, stderr
    assert time.monotonic() - start < STOPPED_WITHIN_S
    assert not any(_apps(hung))
    # multiprocessing's resource tracker, a child too, ends once it reads its parent's end of the pipe close
    assert _wait(lambda: not _alive(workers), 10), f"left behind: {_alive(workers)}"


@pytest.fixture(scope="module")
def finished(phones: Phones, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A lab that ran to its end on both phones: its output folder."""
    root = tmp_path_factory.mktemp("finished")
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvrig",
            "lab",
            "run",
            str(_lab(root / "lab.yaml", short_entry())),
            "-o",
            str(root / "o"),
        ],
        cwd=ROOT,
        env={**os.environ, "USBMUXD_SOCKET_ADDRESS": phones.address},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    return root / "o"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@hostile(6, "a second kvrig lab run into a folder holding a finished lab", "exit 34; not a byte of it changed")
def test_a_used_folder_is_refused_and_left_as_it_was(phones: Phones, finished: Path, tmp_path: Path) -> None:
    before = _snapshot(finished)
    runs = load_model_file(ResultsFile, finished / "results.json").runs
    assert len(runs) == 2 and all(r.outcome == "completed" for r in runs)
    lab = _lab(tmp_path / "lab.yaml", short_entry())
    ran = kvrig("lab", "run", str(lab), "-o", str(finished), env={"USBMUXD_SOCKET_ADDRESS": phones.address})
    assert ran.code == 34, ran.stderr
    assert "holds a lab's results already" in ran.stderr and "Traceback" not in ran.stderr
    assert _snapshot(finished) == before


def _small_disk(limit: int):  # type: ignore[no-untyped-def]
    """A child whose files cannot grow past `limit` bytes: writes fail with EFBIG as a full disk fails them."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@hostile(10, "the disk fills during kvrig lab run", "exit 38 naming the file; no .tmp left, apps stopped")
def test_a_full_disk_during_a_lab_is_its_own_exit_code(phones: Phones, tmp_path: Path) -> None:
    entry = short_entry(soak={"step_tokens": 256, "max_tokens": 1_000_000, "decode_tokens": 1})
    out = tmp_path / "out"
    proc = _start(phones, _lab(tmp_path / "lab.yaml", entry), out, preexec_fn=_small_disk(6 * 1024))
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 38, stderr
    assert "cannot write" in stderr and "Traceback" not in stderr
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert not any(_apps(phones))
    json.loads((out / "results.json").read_text())  # the last results that could be written, whole


@hostile(10, "the disk fills during kvrig lab report", "exit 38; no half-written PNG or report.html")
def test_a_full_disk_during_a_lab_report(finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    ran = subprocess.run(
        [sys.executable, "-m", "kvrig", "lab", "report", str(finished / "results.json"), "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_small_disk(8 * 1024),
    )
    assert ran.returncode == 38, ran.stderr
    assert "cannot write" in ran.stderr and "Traceback" not in ran.stderr
    assert [p.name for p in out.rglob("*") if p.is_file()] == []


@hostile(4, "kvrig lab run with one phone's ProductType a number", "that phone's runs fail with why; the other's pass")
def test_a_malformed_phone_is_that_phones_outcome_in_a_lab(phones: Phones, tmp_path: Path) -> None:
    phones.pro13.faults = FaultPlan(lockdown_values={"ProductType": 7})
    try:
        lab = _lab(tmp_path / "lab.yaml", short_entry())
        ran = kvrig("lab", "run", str(lab), "-o", str(tmp_path / "o"), env={"USBMUXD_SOCKET_ADDRESS": phones.address})
    finally:
        phones.pro13.faults = FaultPlan()
    assert ran.code == 17, ran.stderr
    assert "Traceback" not in ran.stderr
    runs = {r.device.udid: r for r in load_model_file(ResultsFile, tmp_path / "o" / "results.json").runs}
    assert runs[phones.pro15.identity.udid].outcome == "completed"
    bad = runs[phones.pro13.identity.udid]
    assert bad.outcome is None and bad.error is not None and "ProductType is 7" in bad.error
