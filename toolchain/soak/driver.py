"""One soak run on one device: hand the app a soak plan, launch it, watch it grow its context until it ends,
is killed, hangs or the phone goes away, pull what it left behind and say what happened.

The app's side of the protocol (the generated Swift app, or the virtual iPhone's test app): it reads the plan
named by `--kvrig-soak-plan PATH` (PATH inside Documents), writes telemetry JSON Lines into Documents, and
writes an `end` record when it stops on its own. Progress is seen as the telemetry file growing; an app that
is alive but stops writing has hung.

results.json in the output folder is rewritten after every step, so a run that fails half-way leaves what
it learned (`error` names the step).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import toolchain
from toolchain.device import crash
from toolchain.device.apps import get_app
from toolchain.device.discovery import Device
from toolchain.device.files import DOCUMENTS, Container
from toolchain.device.processes import Processes
from toolchain.exceptions import DeviceLostError, DeviceNotFoundError, KvrigError
from toolchain.schemas.results import RESULTS_FILE, DeviceRef, Prediction, ResultsFile, SoakResult
from toolchain.schemas.soakplan import SOAKPLAN_FILE, SOAKPLAN_LAUNCH_ARGUMENT, SoakPlan
from toolchain.soak.analyse import apply_jetsam, apply_telemetry, classify, find_kill, telemetry_run

TELEMETRY_OUT = "telemetry.jsonl"
REPORTS_OUT = "reports"
KILL_WAIT_S = 10.0


@dataclass
class SoakOptions:
    poll_interval_s: float = 0.5
    hang_after_s: float = 120.0  # no telemetry for this long while alive: hung
    timeout_s: float | None = None  # whole run; None: the plan's max_seconds plus hang_after_s, or no limit
    reconnect_s: float = 30.0  # how long a vanished phone may take to come back
    report_wait_s: float = 10.0  # how long the kernel may take to file the JetsamEvent report
    bundle: str | None = None
    extra_arguments: tuple[str, ...] = ()
    predicted: Prediction | None = None
    on_event: Callable[[str], None] | None = None  # progress lines for the CLI


class _Recorder:
    """Keeps results.json current."""

    def __init__(self, out_dir: Path, result: SoakResult, on_event: Callable[[str], None] | None) -> None:
        self.out_dir, self.result, self.on_event = out_dir, result, on_event
        self.save()

    def save(self) -> None:
        data = ResultsFile(tool_version=toolchain.__version__, runs=[self.result]).model_dump(
            mode="json", by_alias=True
        )
        tmp = self.out_dir / f".{RESULTS_FILE}.tmp"
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self.out_dir / RESULTS_FILE)

    def done(self, step: str, message: str | None = None) -> None:
        self.result.steps_done.append(step)
        self.save()
        if message and self.on_event is not None:
            self.on_event(message)

    @contextlib.contextmanager
    def step(self, name: str):  # type: ignore[no-untyped-def]
        try:
            yield
        except KvrigError as exc:
            self.result.error = f"{name}: {exc}"
            self.result.finished = time.time()
            self.save()
            raise


async def run_soak(
    device: Device,
    app_bundle_id: str,
    plan: SoakPlan,
    out_dir: str | Path,
    options: SoakOptions | None = None,
) -> SoakResult:
    """Runs `plan` in the installed app `app_bundle_id`; writes results.json, telemetry and reports to out_dir."""
    opts = options or SoakOptions()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = device.info
    result = SoakResult(
        run_id=plan.run_id,
        device=DeviceRef(
            udid=info.udid, product_type=info.product_type, os_version=info.os_version, profile=info.profile
        ),
        app_id=app_bundle_id,
        bundle=opts.bundle,
        scheme=plan.scheme,
        predicted=opts.predicted,
        started=time.time(),
    )
    rec = _Recorder(out, result, opts.on_event)
    (out / SOAKPLAN_FILE).write_text(plan.model_dump_json(by_alias=True, indent=2) + "\n")

    with rec.step("find app"):
        app = await get_app(device, app_bundle_id)
        result.process = app.executable
        rec.done("find app")
    with rec.step("list crash reports"):
        await crash.flush(device)
        before = set(await crash.list_reports(device))
        rec.done("list crash reports")

    telemetry_remote = f"{DOCUMENTS}/{plan.telemetry_file}"
    with rec.step("write soak plan"):
        async with Container(device, app_bundle_id) as container:
            await container.remove(telemetry_remote)  # appending after a torn line would glue two runs
            await container.write(f"{DOCUMENTS}/{SOAKPLAN_FILE}", plan.model_dump_json(by_alias=True).encode())
        rec.done("write soak plan")

    watch = _Watch(device, app_bundle_id, plan, out / TELEMETRY_OUT, telemetry_remote, opts)
    with rec.step("launch"):
        arguments = [SOAKPLAN_LAUNCH_ARGUMENT, SOAKPLAN_FILE, *opts.extra_arguments]
        async with Processes(device) as processes:
            watch.pid = await processes.launch(app_bundle_id, arguments=arguments)
        rec.done("launch", f"launched {app_bundle_id} as pid {watch.pid}")

    with rec.step("watch"):
        await watch.run()
        if watch.pulled:
            result.files.telemetry = TELEMETRY_OUT
        rec.done("watch", f"run ended: {watch.describe()}")

    jetsam_paths: list[Path] = []
    crash_paths: list[Path] = []
    if not watch.lost:
        with rec.step("pull reports"):
            jetsam_paths, crash_paths = await _pull_new_reports(
                device, before, out / REPORTS_OUT, app.executable, wait_s=opts.report_wait_s if watch.died else 0
            )
            result.files.jetsam_reports = [p.relative_to(out).as_posix() for p in jetsam_paths]
            result.files.crash_reports = [p.relative_to(out).as_posix() for p in crash_paths]
            rec.done("pull reports")

    run = telemetry_run(out / TELEMETRY_OUT, plan.run_id)
    if run is not None:
        apply_telemetry(result, run)
    kill = find_kill(jetsam_paths, app.executable, watch.pid) if not watch.end_seen else None
    result.outcome, detail = classify(
        end_seen=watch.end_seen,
        end_reason=watch.end_reason,
        end_message=run.end.message if run is not None and run.end is not None else None,
        hung=watch.hung,
        timed_out=watch.timed_out,
        lost=watch.lost,
        killed_by_jetsam=kill is not None,
        crash_reports=crash_paths,
    )
    if kill is not None:
        detail = apply_jetsam(result, kill, app.executable, run)
    result.outcome_detail = detail
    result.finished = time.time()
    rec.done("classify", f"outcome: {result.outcome} ({detail})")
    return result


class _Watch:
    """Polls the app's pid and its telemetry file until the run ends; reconnects if the phone comes back."""

    def __init__(
        self, device: Device, bundle_id: str, plan: SoakPlan, local: Path, remote: str, opts: SoakOptions
    ) -> None:
        self.device, self.bundle_id, self.plan = device, bundle_id, plan
        self.local, self.remote, self.opts = local, remote, opts
        self.pid = 0
        self.end_seen = self.hung = self.timed_out = self.lost = self.pulled = False
        self.end_reason: str | None = None
        self.last_size: int | None = None
        timeout = opts.timeout_s
        if timeout is None and plan.stop.max_seconds is not None:
            timeout = plan.stop.max_seconds + opts.hang_after_s
        self.timeout_s = timeout

    def describe(self) -> str:
        for flag, text in (
            (self.lost, "device lost"),
            (self.end_seen, f"end record ({self.end_reason})"),
            (self.hung, "hung"),
            (self.timed_out, "timed out"),
        ):
            if flag:
                return text
        return "the app is gone"

    @property
    def died(self) -> bool:
        """It ended on its own without an end record: the kernel (or a crash) took it."""
        return not (self.end_seen or self.hung or self.timed_out or self.lost)

    async def run(self) -> None:
        start = last_change = time.monotonic()
        while True:
            try:
                async with contextlib.AsyncExitStack() as stack:
                    container = await stack.enter_async_context(Container(self.device, self.bundle_id))
                    processes = await stack.enter_async_context(Processes(self.device))
                    while True:
                        await asyncio.sleep(self.opts.poll_interval_s)
                        now = time.monotonic()
                        alive = await processes.pid_for(self.bundle_id)
                        if await self._poll_telemetry(container):
                            last_change = now
                        if self.end_seen:
                            await self._kill(processes, alive)  # a finished app stays in the foreground
                            return
                        if alive != self.pid:
                            # Gone; a last look for records written just before it died.
                            await self._poll_telemetry(container)
                            return
                        if now - last_change > self.opts.hang_after_s:
                            self.hung = True
                            await self._kill(processes, alive)
                            return
                        if self.timeout_s is not None and now - start > self.timeout_s:
                            self.timed_out = True
                            await self._kill(processes, alive)
                            return
            except (DeviceLostError, DeviceNotFoundError):
                if not await self._reconnect():
                    self.lost = True
                    return
                last_change = time.monotonic()

    async def _poll_telemetry(self, container: Container) -> bool:
        """Pulls the telemetry file when it grew; True if it changed."""
        size = await container.size(self.remote)
        if size is None or size == self.last_size:
            return False
        self.last_size = size
        data = await container.read(self.remote)
        self.local.write_bytes(data)
        self.pulled = True
        run = telemetry_run(self.local, self.plan.run_id)
        if run is not None and run.end is not None:
            self.end_seen, self.end_reason = True, run.end.reason
        return True

    async def _kill(self, processes: Processes, pid: int) -> None:
        """Kills the app and waits (briefly) until the phone no longer lists it."""
        if not pid:
            return
        with contextlib.suppress(KvrigError):  # it may have died on its own meanwhile
            await processes.kill(pid)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and await processes.pid_for(self.bundle_id) == pid:
            await asyncio.sleep(0.1)

    async def _reconnect(self) -> bool:
        deadline = time.monotonic() + self.opts.reconnect_s
        while time.monotonic() < deadline:
            try:
                await self.device.reconnect()
                return True
            except (DeviceLostError, DeviceNotFoundError):
                await asyncio.sleep(min(1.0, self.opts.poll_interval_s * 2))
        return False


async def _pull_new_reports(
    device: Device, before: set[str], out_dir: Path, process: str, *, wait_s: float
) -> tuple[list[Path], list[Path]]:
    """JetsamEvent reports and the app's own crash reports filed since `before`, pulled into out_dir.

    The kernel files the report shortly after the kill, so an app that died without an end record gets
    `wait_s` seconds for its report to appear."""
    deadline = time.monotonic() + wait_s
    while True:
        await crash.flush(device)
        new = [p for p in await crash.list_reports(device) if p not in before]
        jetsam = [p for p in new if crash.JETSAM_PATTERN.match(os.path.basename(p))]
        own = [p for p in new if os.path.basename(p).startswith(f"{process}-")]
        if jetsam or own or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)
    return await crash.pull_reports(device, jetsam, out_dir), await crash.pull_reports(device, own, out_dir)


async def soak(
    app_bundle_id: str,
    plan: SoakPlan,
    out_dir: str | Path,
    *,
    udid: str | None = None,
    options: SoakOptions | None = None,
    usbmux_address: str | None = None,
) -> SoakResult:
    """Connects to the selected device and runs one soak (what `kvrig soak` calls)."""
    from toolchain.device.discovery import connect

    device = await connect(udid, usbmux_address=usbmux_address)
    async with device:
        return await run_soak(device, app_bundle_id, plan, out_dir, options)
