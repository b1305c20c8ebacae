"""One phone's runs, in a process of its own.

Each phone gets one worker process because some device state is process-wide (pymobiledevice3's userspace
tunnel for iOS 17+, `USBMUXD_SOCKET_ADDRESS`): phones on different hosts or needing their own tunnel cannot
share one. `drive_phone` is the one function a worker calls; it reports back through `emit`, which the parent
(`schedule`) turns into saved results and progress lines.

A worker dies with its parent: the kernel sends it SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG; a
thread watching the parent's pid elsewhere). SIGTERM, from the dying parent or from a parent that is stopping
the lab (Ctrl-C, SIGTERM, a results file it cannot write), cancels the run in progress, which stops the app it
launched; the worker then reports the run and exits, or is ended by force after STOP_S. Ctrl-C itself is the
parent's to handle: the terminal sends it to every process of the group, and a worker ignores it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrig.device import apps, files
from kvrig.device.loop import run_async
from kvrig.device.session import open_session
from kvrig.exceptions import DeviceLostError, DeviceNotFoundError, KvrigError, Terminated
from kvrig.lab.model import LabRun
from kvrig.lab.threshold import Bench, measure
from kvrig.schemas.lab import Lab, MatrixEntry
from kvrig.schemas.results import SoakResult, short_udid
from kvrig.soaking.driver import tunnel_ref

# (kind, udid, payload): ("event", udid, line), ("run", udid, (index, result JSON)), ("done", udid, None),
# ("crashed", udid, traceback text), ("stopped", udid, None): told to stop, its runs reported
Message = tuple[str, str, Any]
STOP_S = 15.0  # from SIGTERM to the worker's end: the app stopped (STOP_APP_S), the run reported, the link closed
PARENT_POLL_S = 0.5
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
Emit = Callable[[Message], None]


@dataclass
class PhoneJob:
    """Everything a worker needs, picklable: the lab, where to write, which phone on which usbmuxd, its runs."""

    lab: Lab
    out: Path
    udid: str
    usbmux_address: str | None
    runs: list[LabRun]
    tunnel: str = "auto"  # --tunnel: auto, userspace, tunneld[=HOST:PORT], none (each worker opens its own)


async def drive_phone(job: PhoneJob, emit: Emit) -> None:
    """Runs the phone's runs one after another: install and push once per entry, then each run with its
    threshold search. A lost phone fails the run it was in; later runs wait for it to come back.

    The phone is opened as a soak opens it (`open_session`): preflight first, whose blocking cause fails every
    run, then the tunnel (iOS 17+), held for all of them and recorded in each run's result."""

    tag = short_udid(job.udid)

    def say(line: str) -> None:
        emit(("event", job.udid, line))

    def saved(run: LabRun) -> None:
        emit(("run", job.udid, (job.runs.index(run), run.result.model_dump_json(by_alias=True))))

    bench = Bench(job.lab, job.out, say, saved)
    async with contextlib.AsyncExitStack() as stack:
        try:
            device = await stack.enter_async_context(
                open_session(job.udid, tunnel=job.tunnel, usbmux_address=job.usbmux_address)
            )
        except KvrigError as exc:
            for run in job.runs:
                not_run(run, exc)
                saved(run)
            return
        if device.tunnel is not None:
            say(f"{tag}: tunnel {device.tunnel.kind} ({device.tunnel.plan.reason})")
        for run in job.runs:  # a run that fails before its soak still says which tunnel it had
            run.result.tunnel = tunnel_ref(device)
        prepared: set[str] = set()
        lost: KvrigError | None = None
        for run in job.runs:
            if lost is not None and not await _came_back(device):
                not_run(run, lost, earlier=True)
                saved(run)
                continue
            lost = None
            say(f"{tag}: {run.label}")
            try:
                if run.entry.label not in prepared:
                    await prepare(device, run.entry)
                    prepared.add(run.entry.label)
                await measure(bench, device, run, tag)
            except asyncio.CancelledError:
                run.result.error = run.result.error or "interrupted: the lab was stopped during this run"
                run.result.finished = run.result.finished or time.time()
                saved(run)
                raise
            except (DeviceLostError, DeviceNotFoundError) as exc:
                lost = exc
                not_run(run, exc)
            except KvrigError as exc:
                run.result.error = run.result.error or str(exc)
                say(f"{tag}: {run.label}: error: {exc}")
            if run.result.outcome == "device_lost" or any(c.outcome == "device_lost" for c in run.result.confirmations):
                lost = lost or DeviceLostError(f"device {job.udid} went away")
            say(f"{tag}: {summary(run.result)}")
            saved(run)


async def prepare(device: Any, entry: MatrixEntry) -> None:
    """Installs the entry's app and pushes its bundle (once per device)."""

    if entry.bundle_path is not None:
        files.deployable(entry.bundle_path)  # before the app is installed: a bundle that cannot go, stops here
    if entry.ipa is not None:
        await apps.install(device, entry.ipa)
    if entry.bundle_path is not None:
        await files.push_bundle(device, entry.app_id, entry.bundle_path)


def not_run(run: LabRun, exc: KvrigError, *, earlier: bool = False) -> None:
    r = run.result
    if isinstance(exc, DeviceLostError | DeviceNotFoundError):
        r.outcome = "device_lost"
        r.outcome_detail = (
            f"not run: the device was lost during an earlier run ({exc})" if earlier else f"device lost: {exc}"
        )
        r.finished = r.finished or time.time()
    else:
        r.error = r.error or str(exc)


async def _came_back(device: Any) -> bool:
    with contextlib.suppress(KvrigError):
        await device.reconnect()
        return True
    return False


def summary(r: SoakResult) -> str:
    confirmed = " confirmed" if r.max_safe_context_confirmed else ""
    outcome = r.outcome or f"no outcome ({r.error})"
    return f"{r.entry} / {r.variant}: {outcome}, max safe context {r.max_safe_context}{confirmed}"


def worker_main(job: PhoneJob, queue: Any, parent: int) -> None:
    """The worker process: bound to its parent's life, this phone's usbmuxd for everything in the process, then
    `drive_phone`."""
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if job.usbmux_address is not None:
        os.environ["USBMUXD_SOCKET_ADDRESS"] = job.usbmux_address
    try:
        run_async(drive_phone(job, queue.put))
    except Terminated:
        queue.put(("stopped", job.udid, None))
        return
    except BaseException:  # reported to the parent, which fails this phone's unfinished runs
        queue.put(("crashed", job.udid, traceback.format_exc()))
        raise
    queue.put(("done", job.udid, None))


def die_with_parent(parent: int) -> None:
    """SIGTERM to this process when `parent` dies, and its end by force STOP_S later."""
    kernel = sys.platform.startswith("linux")
    if kernel:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it died before the kernel was asked to tell
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=_watch_parent, args=(parent, kernel), name="kvrig-parent", daemon=True).start()


def _watch_parent(parent: int, kernel_signals: bool) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    if not kernel_signals:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_S)
    os._exit(Terminated.exit_code)
