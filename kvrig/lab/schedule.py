"""Scheduling: the runs laid out per phone (with predictions), one worker process per phone started in
parallel, and every result a worker reports saved as it arrives.

A lab writes only into a folder no lab has written (LabOutputExistsError otherwise), so a second run never
overwrites the first's results or its runs/. When the lab stops early (Ctrl-C, SIGTERM, a results file it cannot
write), every worker is told to stop (SIGTERM: each stops its app and reports its run) and given STOP_S in all,
then ended by force; the runs that did not finish say so, and what was learned is saved."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue as queue_module
import time
from pathlib import Path
from typing import Any

from kvrig.device.hosts import UsbmuxHost, list_devices_on, local_host
from kvrig.exceptions import LabError, LabOutputExistsError, OutputWriteError
from kvrig.fileio import check_folder_possible
from kvrig.lab.check import check_lab
from kvrig.lab.model import JUNIT_FILE, RUNS_DIR, Event, LabResults, LabRun, device_ref, new_run
from kvrig.lab.predict import Predictor, installed_entitlements, ipa_entitlements
from kvrig.lab.report import IMAGES_DIR, REPORT_FILE, write_report
from kvrig.lab.save import save_results
from kvrig.lab.targets import Shard, Target, select_targets
from kvrig.lab.worker import STOP_S, PhoneJob, worker_main
from kvrig.schemas.lab import Lab
from kvrig.schemas.results import RESULTS_FILE, SoakResult, short_udid

POLL_S = 0.5
LAB_OUTPUTS = (RESULTS_FILE, JUNIT_FILE, REPORT_FILE, IMAGES_DIR, RUNS_DIR)


def claim_output(out: Path) -> None:
    """Makes `out` this lab's: refused when a lab has written there (or is starting there now)."""
    check_folder_possible(out, "the lab's output folder")  # a file there is not "a lab's results already"
    try:
        out.mkdir(parents=True, exist_ok=True)
        found = [name for name in LAB_OUTPUTS if (out / name).exists() or (out / name).is_symlink()]
        if not found:
            (out / RUNS_DIR).mkdir()  # the claim itself: of two labs starting at once, one makes it
    except FileExistsError:
        found = [RUNS_DIR]
    except OSError as exc:
        raise OutputWriteError(f"{out}: cannot create the lab's output folder: {exc.strerror or exc}") from None
    if found:
        raise LabOutputExistsError(
            f"{out}: holds a lab's results already ({', '.join(found)}); a lab never overwrites another's: "
            "give another -o, or remove that folder first"
        )


class Scheduler:
    def __init__(
        self,
        lab: Lab,
        out: Path,
        on_event: Event | None,
        hosts: list[UsbmuxHost],
        tunnel: str = "auto",
        limits: Path | None = None,
    ) -> None:
        self.lab, self.out, self.on_event, self.hosts = lab, out, on_event, hosts
        self.limits = limits  # a limits registry: predictions plan against the limit each phone stated
        self.tunnel = tunnel  # each worker opens its phone's own tunnel (`--tunnel`)
        self.results = LabResults(lab, out, [], hosts=[h.name for h in hosts])
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.runs_of: dict[str, list[LabRun]] = {}  # udid -> its runs, while workers drive them

    def say(self, line: str) -> None:
        if self.on_event is not None:
            self.on_event(line)

    def save(self) -> None:
        results = self.results.results
        save_results(results, self.out)
        for run, saved in zip(self.results.runs, results.runs, strict=True):
            run.result.gates = saved.gates

    async def plan_runs(self, targets: list[Target]) -> dict[str, list[LabRun]]:
        """Each phone's runs, predicted against the limit each run's app gets there."""
        predictor = Predictor(self.results.notes, limits=self.limits)
        from_ipa = ipa_entitlements(self.lab.matrix)  # the .ipa the lab installs says what the app will declare
        listed = await installed_entitlements(self.lab.matrix, targets, self.hosts, known=from_ipa)
        only_host = self.hosts[0].name if len(self.hosts) == 1 else None
        per_device: dict[str, list[LabRun]] = {}
        for target in targets:
            ref = device_ref(target.udid, target.info, target.host or only_host)
            runs = per_device.setdefault(target.udid, [])
            for entry in self.lab.matrix:
                for scheme in entry.schemes:
                    for residency in entry.runs_residencies:
                        predicted = None
                        if target.problem is None:
                            virtual = bool(target.info and target.info.virtual)
                            entitled = from_ipa.get(entry.app_id, listed.get((target.udid, entry.app_id)))
                            predicted = predictor.predict(
                                entry,
                                scheme,
                                ref.profile,
                                target.spec,
                                virtual=virtual,
                                residency=residency,
                                phone=ref,
                                entitled=entitled,
                            )
                        on_critical = self.lab.on_critical_for(entry)
                        run = new_run(entry, scheme, ref, self.stamp, predicted, residency, on_critical)
                        if target.problem is not None:
                            run.result.error = f"device: {target.problem}"
                        runs.append(run)
        self.results.runs = [r for runs in per_device.values() for r in runs]
        return per_device

    async def run(self, shard: Shard | None, devices: list[str] | None) -> LabResults:
        attached, unreachable = await list_devices_on(self.hosts)
        for host, why in unreachable.items():
            self.results.notes.append(f"host {host}: {why}")
            self.say(f"host {host}: {why}")
        targets = select_targets(self.lab, attached, shard=shard, devices=devices)
        per_device = await self.plan_runs(targets)
        self.save()
        if not targets and shard is not None and select_targets(self.lab, attached, devices=devices):
            # Hashing leaves some shards without phones (3 phones, 4 shards): nothing to do is not a failure.
            note = f"shard {shard} owns none of the phones the lab selects; nothing to run"
            self.results.notes.append(note)
            self.say(note)
            self.save()
            return self.results
        if not targets:
            seen = ", ".join(f"{d.udid} ({d.profile}) on {d.host}" for d in attached) or "none"
            share = f" in shard {shard}" if shard else ""
            raise LabError(f"no attached device matches the lab's devices{share} (attached: {seen})")
        for t in targets:
            if t.problem is not None:
                self.say(f"{t.udid}: {t.problem}; its runs are not made")
        address = {h.name: h.address for h in self.hosts}
        jobs = [
            PhoneJob(self.lab, self.out, t.udid, address.get(t.host or ""), per_device[t.udid], self.tunnel)
            for t in targets
            if t.problem is None
        ]
        await self.drive(jobs)
        self.save()
        return self.results

    async def drive(self, jobs: list[PhoneJob]) -> None:
        """One worker process per phone; their reports are applied here, in the one process that writes."""
        if not jobs:
            return
        # spawn, not fork: the parent may hold threads (an embedded virtual iPhone, asyncio's executor).
        ctx = multiprocessing.get_context("spawn")
        messages = ctx.Queue()
        parent = os.getpid()
        workers = {job.udid: ctx.Process(target=worker_main, args=(job, messages, parent), daemon=True) for job in jobs}
        self.runs_of = {job.udid: job.runs for job in jobs}
        for worker in workers.values():
            worker.start()
        open_ = set(workers)
        finished = False
        try:
            while open_:
                try:
                    message = await asyncio.to_thread(messages.get, True, POLL_S)
                except queue_module.Empty:
                    for udid in [u for u in open_ if not workers[u].is_alive()]:
                        self._worker_died(self.runs_of[udid], f"exit code {workers[udid].exitcode}")
                        open_.discard(udid)
                    continue
                if self._apply(message):
                    open_.discard(message[1])
            finished = True
        finally:
            if not finished:
                self._stop(workers, messages)
            for worker in workers.values():
                worker.join(timeout=10)
                if worker.is_alive():
                    worker.kill()
                    worker.join()
            messages.close()

    def _apply(self, message: tuple[str, str, Any]) -> bool:
        """Applies one worker message; True when that worker is finished."""
        kind, udid, payload = message
        if kind == "event":
            self.say(payload)
        elif kind == "run":
            index, data = payload
            self.runs_of[udid][index].result = SoakResult.model_validate_json(data)
            self.save()
        elif kind == "crashed":
            self.say(f"{short_udid(udid)}: the worker failed:\n{payload}")
            self._worker_died(self.runs_of[udid], payload.strip().splitlines()[-1])
        return kind in ("crashed", "done", "stopped")

    def _stop(self, workers: dict[str, Any], messages: Any) -> None:
        """The lab is stopping early: SIGTERM to every worker (each stops its app and reports its run), STOP_S
        for all of them, then SIGKILL; what they reported is kept and the runs left unfinished say so."""
        self.say(f"stopping: each phone's app, then its worker (at most {STOP_S:g} s)")
        for worker in workers.values():
            if worker.is_alive():
                worker.terminate()
        deadline = time.monotonic() + STOP_S
        for worker in workers.values():
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in workers.values():
            if worker.is_alive():
                worker.kill()
        with contextlib.suppress(queue_module.Empty, OSError, ValueError, EOFError):
            while True:
                kind, udid, payload = messages.get(timeout=0.2)
                if kind == "run":
                    index, data = payload
                    self.runs_of[udid][index].result = SoakResult.model_validate_json(data)
        for run in self.results.runs:
            if run.result.outcome is None and run.result.error is None:
                run.result.error = "interrupted: the lab was stopped before this run finished"
        with contextlib.suppress(OutputWriteError):  # the stop may be because nothing can be written
            self.save()

    def _worker_died(self, runs: list[LabRun], why: str) -> None:
        for run in runs:
            if run.result.outcome is None and run.result.error is None:
                run.result.error = f"the worker process for this phone ended before the run ({why})"
        self.save()


async def run_lab(
    lab: Lab,
    out_dir: str | Path,
    *,
    on_event: Event | None = None,
    hosts: list[UsbmuxHost] | None = None,
    shard: Shard | None = None,
    devices: list[str] | None = None,
    tunnel: str = "auto",
    limits: str | Path | None = None,
) -> LabResults:
    """Runs the lab (or this runner's share of it) on the phones of `hosts`, each through the tunnel `tunnel`
    asks for (auto, userspace, tunneld[=HOST:PORT], none); writes results.json, junit.xml and report.html.
    `limits`: a limits registry (`kvrig calibrate --limits`) whose measured limits the predictions use."""
    check_lab(lab)  # the command checked it naming the file; a library caller gets the same check
    out = Path(out_dir)
    claim_output(out)
    scheduler = Scheduler(lab, out, on_event, hosts or [local_host()], tunnel, Path(limits) if limits else None)
    scheduler.results.shard = str(shard) if shard else None
    results = await scheduler.run(shard, devices)

    title = f"kvrig lab: {lab.name}" + (f" (shard {shard})" if shard else "")
    write_report(results.results, out, title=title)
    return results
