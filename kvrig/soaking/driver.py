"""One soak run on one device: hand the app a soak plan, launch it, watch it grow its context until it ends,
is killed, hangs or the phone goes away, pull what it left behind and say what happened.

The app's side of the protocol (the generated Swift app, or the virtual iPhone's test app): it reads the plan
named by `--kvrig-soak-plan PATH` (PATH inside Documents), writes telemetry JSON Lines into Documents, and
writes an `end` record when it stops on its own. Progress is seen as the telemetry file growing; an app that
is alive but stops writing has hung.

results.json in the output folder is rewritten after every step, so a run that fails half-way leaves what
it learned (`error` names the step).

Every read from the phone is bounded (`files.Bounds`): the telemetry is pulled as it grows, only the new bytes,
and only the new lines are looked at for the end record, up to TELEMETRY.max_bytes in all; each poll within
the run's own times (CALL_TIMEOUT_S, never longer than `hang_after_s`); reports within `report_wait_s` plus
CALL_TIMEOUT_S, one bad entry skipped with why. A run that fails or is interrupted (Ctrl-C, SIGTERM, its lab
worker told to stop) stops the app it launched before it ends: tried again until it is gone or STOP_APP_S has
passed, run to its end whatever further cancels arrive (`to_the_end`), and its verdict saved in results.json
("the app was stopped" or why it may still run; "stopping the app" if the process was ended by force meanwhile).

On iOS 17+ the run goes through one tunnel (see `kvrig.device.session`), held for the whole run. When
process control stops answering, os_trace's process list (over lockdown, no tunnel) tells a dropped tunnel
from a vanished phone; either may come back within `reconnect_s` and the run resumes, else it ends as
device_lost with `lost` saying which. Battery temperature, level and charging state are sampled throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from kvrig.device import crash, ostrace
from kvrig.device.apps import AppInfo, get_app
from kvrig.device.battery import BatteryReader
from kvrig.device.discovery import Device
from kvrig.device.files import DOCUMENTS, Bounds, Container
from kvrig.device.loop import bounded, to_the_end
from kvrig.device.processes import Processes
from kvrig.device.session import open_session
from kvrig.device.syslog import LogFollower
from kvrig.device.tunnel import HANDSHAKE_TIMEOUT_S, TunnelMode
from kvrig.exceptions import (
    CoreMLBackendError,
    CoreMLVirtualPhoneError,
    DeviceLostError,
    DeviceNotFoundError,
    KvrigError,
    NoTunnelError,
    SoakOutputExistsError,
)
from kvrig.fileio import atomic_write, make_folder
from kvrig.reports.devicelog import AppLog
from kvrig.reports.telemetry import end_record
from kvrig.schemas.keys import COREML_MODEL_KEY
from kvrig.schemas.results import (
    RESULTS_FILE,
    BatterySample,
    DeviceRef,
    Interruption,
    Prediction,
    ResultsFile,
    SoakResult,
    TunnelRef,
)
from kvrig.schemas.soakplan import SOAKPLAN_FILE, SOAKPLAN_LAUNCH_ARGUMENT, SoakPlan
from kvrig.soaking.analyse import apply_jetsam, apply_telemetry, classify, find_kill, stated_limit, telemetry_run
from kvrig.soaking.background import BackgroundSteps, Phase
from kvrig.version import __version__

T = TypeVar("T")
TELEMETRY_OUT = "telemetry.jsonl"
REPORTS_OUT = "reports"
KILL_WAIT_S = 10.0
CALL_TIMEOUT_S = 30.0  # one poll of the phone; a tunnel whose transport died may never answer
MIN_READ_S = 5.0  # a telemetry read gets at least this long, however short `hang_after_s` is
STOP_APP_S = 10.0  # stopping the app when a run fails or is interrupted, every try included
STOP_TRY_S = 4.0  # one try: open process control, find the app, kill it, see it gone
LOG_DRAIN_S = 1.0  # the kernel's and SpringBoard's lines about a dead app follow its death by a moment
# A soak's telemetry is about 1 MiB at most (a step record every few hundred tokens); 16 MiB is an app gone wrong.
TELEMETRY = Bounds(16 * 1024 * 1024, CALL_TIMEOUT_S)


@dataclass
class SoakOptions:
    poll_interval_s: float = 0.5
    hang_after_s: float = 120.0  # no telemetry for this long while alive: hung
    timeout_s: float | None = None  # whole run; None: the plan's max_seconds plus hang_after_s, or no limit
    reconnect_s: float = 30.0  # how long a vanished phone (or a dropped tunnel) may take to come back
    report_wait_s: float = 10.0  # how long the kernel may take to file the JetsamEvent report
    bundle: str | None = None
    extra_arguments: tuple[str, ...] = ()
    predicted: Prediction | None = None
    on_event: Callable[[str], None] | None = None  # progress lines for the CLI
    battery_interval_s: float | None = 5.0  # None: no battery sampling
    tunnel: TunnelMode | str | None = None  # for `soak()`: auto, userspace, tunneld[=HOST:PORT], none
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    background: tuple[Phase, ...] = ()  # send the app to the background during these phases (soaking.background)
    background_s: float = 5.0  # how long it stays there each time


class _Recorder:
    """Keeps results.json current."""

    def __init__(self, out_dir: Path, result: SoakResult, on_event: Callable[[str], None] | None) -> None:
        self.out_dir, self.result, self.on_event = out_dir, result, on_event
        self.save()

    def save(self) -> None:
        data = ResultsFile(tool_version=__version__, runs=[self.result]).model_dump(mode="json", by_alias=True)
        atomic_write(self.out_dir / RESULTS_FILE, json.dumps(data, indent=2) + "\n")

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
            udid=info.udid,
            product_type=info.product_type,
            os_version=info.os_version,
            build_version=info.build_version,
            profile=info.profile,
            virtual=info.virtual,
        ),
        app_id=app_bundle_id,
        bundle=opts.bundle,
        scheme=plan.scheme,
        backend=plan.backend,
        weights_residency_requested=plan.weights_residency,
        on_critical=plan.on_critical,
        predicted=opts.predicted,
        started=time.time(),
        tunnel=tunnel_ref(device),
    )
    rec = _Recorder(out, result, opts.on_event)
    (out / SOAKPLAN_FILE).write_text(plan.model_dump_json(by_alias=True, indent=2) + "\n")

    with rec.step("find app"):
        app = await get_app(device, app_bundle_id)
        result.process = app.executable
        check_backend(plan, app, device.udid)
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

    watch = _Watch(device, app_bundle_id, app.executable, plan, out / TELEMETRY_OUT, telemetry_remote, opts)
    battery = _BatterySampler(device, rec, opts.battery_interval_s)
    away = BackgroundSteps(
        device, app_bundle_id, out / TELEMETRY_OUT, plan.run_id, opts.background, opts.background_s, opts.on_event
    )
    await battery.start()
    # The device log, followed from before the launch: the limit runningboardd states as the app starts, and
    # how it ended (the kernel's jetsam lines, a GPU-from-background abort, the watchdog).
    applog = AppLog(app.executable, app_bundle_id)
    follower = LogFollower(device, applog.feed)
    try:
        await follower.start()
        with rec.step("launch"):
            arguments = [SOAKPLAN_LAUNCH_ARGUMENT, SOAKPLAN_FILE, *opts.extra_arguments]
            async with Processes(device) as processes:
                watch.pid = await processes.launch(app_bundle_id, arguments=arguments)
            applog.pid = watch.pid
            rec.done("launch", f"launched {app_bundle_id} as pid {watch.pid}")

        with rec.step("watch"):
            away.start(watch.pid)
            await watch.run()
            if watch.pulled:
                result.files.telemetry = TELEMETRY_OUT
            rec.done("watch", f"run ended: {watch.describe()}")
    except BaseException as exc:
        interrupted = isinstance(exc, asyncio.CancelledError | KeyboardInterrupt)
        if interrupted:
            result.error = result.error or f"interrupted during {_current_step(result)}"
            result.finished = time.time()
        if watch.pid and not watch.lost:
            told = result.error
            if interrupted:
                result.error = f"{told}; stopping the app"  # what stays if the process is ended by force meanwhile
                rec.save()
            failed = await to_the_end(_stop_app(device, app_bundle_id, watch.pid))
            if interrupted:
                # Said only once it is so: an app left running is what the next run on this phone meets.
                result.error = (
                    f"{told}; the app was stopped" if failed is None else f"{told}; the app may still run: {failed}"
                )
            rec.save()
        raise
    finally:
        await away.stop()
        await follower.stop(LOG_DRAIN_S if watch.died else 0.0)
        result.interruptions = watch.interruptions
        result.tunnel = tunnel_ref(device)
        if watch.pulled:
            result.files.telemetry = TELEMETRY_OUT
        rec.save()
        await battery.stop()

    jetsam_paths: list[Path] = []
    crash_paths: list[Path] = []
    lost_after: str | None = None
    if not watch.lost:
        with rec.step("pull reports"):
            try:
                jetsam_paths, crash_paths, skipped = await _pull_new_reports(
                    device, before, out / REPORTS_OUT, app.executable, wait_s=opts.report_wait_s if watch.died else 0
                )
            except (DeviceLostError, DeviceNotFoundError, NoTunnelError):
                # The phone went between the watch's end and the reports: a run like any other that lost its
                # phone (what the telemetry holds is kept), not an error; the reports stay on the phone.
                lost_after = watch.describe()
                watch.lost, watch.lost_cause = True, "device"
            else:
                result.files.jetsam_reports = [p.relative_to(out).as_posix() for p in jetsam_paths]
                result.files.crash_reports = [p.relative_to(out).as_posix() for p in crash_paths]
                result.files.skipped_reports = skipped
                rec.done("pull reports")

    run = telemetry_run(out / TELEMETRY_OUT, plan.run_id)
    if run is not None:
        apply_telemetry(result, run)
        # Step times put tok/s on the battery samples' time axis (a report plots both: heat slows decoding).
        for point, step in zip(result.tps_curve, run.steps, strict=True):
            point.t = step.t
    kill = find_kill(jetsam_paths, app.executable, watch.pid) if not watch.end_seen else None
    result.stated_limit = stated_limit(applog, result.device, app.entitled)
    result.outcome, detail, result.evidence = classify(
        end_seen=watch.end_seen,
        end_reason=watch.end_reason,
        end_message=run.end.message if run is not None and run.end is not None else None,
        hung=watch.hung,
        timed_out=watch.timed_out,
        lost=watch.lost,
        killed_by_jetsam=kill is not None,
        crash_reports=crash_paths,
        jetsam_report=kill.path if kill is not None else None,
        log=applog if watch.died else None,
        base=out,
    )
    if kill is not None:
        detail = apply_jetsam(result, kill, app.executable, run)
    if opts.background:
        gpu_in_log = result.outcome == "gpu_background"
        result.background = away.judge(run, crash_paths, died=watch.died, gpu_in_log=gpu_in_log)
        detail += "; background: " + ", ".join(f"{b.requested} {b.result}" for b in result.background)
    if watch.lost:
        result.lost = watch.lost_cause
        if lost_after is not None:
            detail = (
                f"the device went away after the watch ended ({lost_after}) and before its crash and JetsamEvent "
                "reports were pulled; they stay on the phone"
            )
        elif watch.lost_cause == "tunnel":
            detail = (
                "tunnel lost: the phone stayed attached but its tunnel did not come back in "
                f"{watch.gave_up_after_s:g} s of trying (--reconnect {opts.reconnect_s:g}; the app may still run: "
                "kvrig cannot stop it without one); everything learned until then is kept"
            )
    result.outcome_detail = detail
    result.finished = time.time()
    rec.done("classify", f"outcome: {result.outcome} ({detail})")
    return result


def _current_step(result: SoakResult) -> str:
    done = result.steps_done
    return "launch" if "launch" not in done else "watch"


async def _stop_app(device: Device, bundle_id: str, pid: int) -> str | None:
    """Kills the app this run launched and sees it gone, each try within STOP_TRY_S, tried again until STOP_APP_S
    has passed; best effort (the phone may be what failed). None when it is stopped, else why not."""

    async def stop() -> None:
        async with Processes(device) as processes:
            if await processes.pid_for(bundle_id) == pid:
                await processes.kill(pid)
            while await processes.pid_for(bundle_id) == pid:  # killed is not yet gone
                await asyncio.sleep(0.1)

    deadline = time.monotonic() + STOP_APP_S
    why, tries = "not tried", 0
    while (left := deadline - time.monotonic()) > 0:
        tries += 1
        try:
            await bounded(stop(), min(left, STOP_TRY_S))
            return None
        except TimeoutError:
            why = f"no answer within {min(left, STOP_TRY_S):.3g} s"
        except Exception as exc:  # whatever the phone did, the error being unwound is the one to raise
            why = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
    return f"{why} (the last of {tries} tries in {STOP_APP_S:g} s)"


def check_backend(plan: SoakPlan, app: AppInfo, udid: str) -> None:
    """Refuses a Core ML soak the app cannot run, before anything is written to the phone: an app rendered
    without `--coreml`, or one on the virtual iPhone (MLX on Linux; Core ML exists only on Apple's OSes)."""
    if plan.backend != "coreml":
        return
    if app.virtual_runtime is not None:
        raise CoreMLVirtualPhoneError(
            f"{app.bundle_id} on {udid} runs on the virtual iPhone ({app.virtual_runtime} runtime), which has no "
            "Core ML: soak it with --backend mlx, or run the Core ML soak on a real iPhone (iOS 18+)"
        )
    if app.coreml_model is None:
        raise CoreMLBackendError(
            f"{app.bundle_id} on {udid} does not carry a Core ML model (no {COREML_MODEL_KEY} in its Info.plist): "
            "render it with `kvrig app --coreml Model.mlpackage` (from `kvrig export coreml`), or soak with "
            "--backend mlx"
        )


def tunnel_ref(device: Device) -> TunnelRef | None:
    tunnel = device.tunnel
    if tunnel is None or tunnel.kind is None:
        return None
    plan = tunnel.plan
    return TunnelRef(kind=tunnel.kind, mode=plan.mode, reason=plan.reason, tunneld=plan.tunneld, opened=tunnel.opened)


class _BatterySampler:
    """Reads the battery every `interval_s` into the result (saving results.json each time); a read that fails
    (the link is down) is skipped, never fatal."""

    def __init__(self, device: Device, rec: _Recorder, interval_s: float | None) -> None:
        self.rec, self.interval_s = rec, interval_s
        self.reader = BatteryReader(device)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.interval_s is not None:
            await self.sample()  # the state before the app starts
            self.task = asyncio.create_task(self._loop(), name="kvrig-battery")

    async def sample(self) -> None:
        try:
            read = await bounded(self.reader.read(), CALL_TIMEOUT_S)
        except (KvrigError, TimeoutError):
            await self.reader.close()
            return
        self.rec.result.battery.append(BatterySample(**read.to_json()))
        self.rec.save()

    async def _loop(self) -> None:
        assert self.interval_s is not None
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sample()

    async def stop(self) -> None:
        if self.interval_s is None:
            return
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
        await self.sample()  # the state at the end
        await self.reader.close()


class _Watch:
    """Polls the app's pid and its telemetry file until the run ends; resumes after a dropped tunnel or an
    unplug when the phone comes back in time."""

    def __init__(
        self,
        device: Device,
        bundle_id: str,
        process: str,
        plan: SoakPlan,
        local: Path,
        remote: str,
        opts: SoakOptions,
    ) -> None:
        self.device, self.bundle_id, self.process, self.plan = device, bundle_id, process, plan
        self.local, self.remote, self.opts = local, remote, opts
        self.interruptions: list[Interruption] = []
        self.lost_cause: Literal["tunnel", "device"] | None = None
        # How long recovery tried before giving up: a try that began before the deadline (pymobiledevice3's own
        # handshake bounds are seconds long) can end well after it.
        self.gave_up_after_s = 0.0
        self.pid = 0
        self.end_seen = self.hung = self.timed_out = self.lost = self.pulled = False
        self.end_reason: str | None = None
        self.last_size: int | None = None
        self.offset = 0  # bytes of the remote telemetry file held in `local`
        self.scanned = 0  # where the first line not yet looked at for the end record starts in `local`
        timeout = opts.timeout_s
        if timeout is None and plan.stop.max_seconds is not None:
            timeout = plan.stop.max_seconds + opts.hang_after_s
        self.timeout_s = timeout
        # No read outlasts what the run itself would wait for: a read that long is no progress (a hang).
        self.read_bounds = Bounds(TELEMETRY.max_bytes, max(MIN_READ_S, min(TELEMETRY.timeout_s, opts.hang_after_s)))

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
                        alive = await _call(processes.pid_for(self.bundle_id), "looking up the app")
                        if await self._pull_telemetry(container):
                            last_change = now
                        if self.end_seen:
                            await self._kill(processes, alive)  # a finished app stays in the foreground
                            return
                        if alive != self.pid:
                            # Gone; a last look for records written just before it died.
                            await self._pull_telemetry(container)
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
                if not await self._recover():
                    self.lost = True
                    if self.lost_cause == "tunnel":
                        await self._last_look()
                    return
                last_change = time.monotonic()

    async def _last_look(self) -> None:
        """Only the tunnel is gone: lockdown still reaches the app's files, so pull what it wrote last."""
        with contextlib.suppress(KvrigError):
            async with Container(self.device, self.bundle_id) as container:
                await self._pull_telemetry(container)

    async def _pull_telemetry(self, container: Container) -> bool:
        # The read keeps its own deadline (DeviceFileError); the stat before it gets the usual one.
        return await _call(
            self._poll_telemetry(container), "pulling telemetry", CALL_TIMEOUT_S + self.read_bounds.timeout_s
        )

    async def _poll_telemetry(self, container: Container) -> bool:
        """Pulls what the telemetry file gained since the last poll; True if it changed."""
        size = await container.size(self.remote)
        if size is None or size == self.last_size:
            return False
        self.last_size = size
        if size < self.offset:  # written again from the start: nothing held so far is that file
            self.offset = self.scanned = 0
        self.offset += await container.append_new(self.remote, self.local, self.offset, self.read_bounds)
        self.pulled = True
        self._look_for_the_end()
        return True

    def _look_for_the_end(self) -> None:
        """Reads the whole lines pulled since the last look (a torn last line waits for the next poll)."""
        with self.local.open("rb") as f:
            f.seek(self.scanned)
            for line in f:
                if not line.endswith(b"\n"):
                    break
                self.scanned += len(line)
                end = end_record(line, self.plan.run_id)
                if end is not None:
                    self.end_seen, self.end_reason = True, end.reason

    async def _kill(self, processes: Processes, pid: int) -> None:
        """Kills the app and waits (briefly) until the phone no longer lists it."""
        if not pid:
            return
        with contextlib.suppress(KvrigError):  # it may have died on its own meanwhile
            await processes.kill(pid)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and await _call(processes.pid_for(self.bundle_id), "looking up") == pid:
            await asyncio.sleep(0.1)

    async def _recover(self) -> bool:
        """The link broke: wait (up to reconnect_s) for the phone and its tunnel; True once the run can go on.

        os_trace's process list answers over lockdown with no tunnel: if it answers, the phone is still
        attached and only the tunnel dropped (reopen it); if not, the phone went away (reconnect everything)."""
        noticed, began = time.time(), time.monotonic()
        deadline = began + self.opts.reconnect_s
        cause: Literal["tunnel", "device"] | None = None
        while True:
            try:
                try:
                    app_pid = await _call(ostrace.pid_of(self.device, self.process), "listing processes")
                    cause = cause or (
                        "tunnel" if self.device.tunnel is not None and self.device.tunnel.needed else "device"
                    )
                    await self.device.reopen_tunnel()
                except (DeviceLostError, DeviceNotFoundError):
                    cause = "device" if cause is None else cause
                    await self.device.reconnect()
                    app_pid = await _call(ostrace.pid_of(self.device, self.process), "listing processes")
            except (DeviceLostError, DeviceNotFoundError, NoTunnelError):
                if time.monotonic() >= deadline:
                    self.lost_cause = cause or "device"
                    self.gave_up_after_s = round(time.monotonic() - began, 1)
                    self.interruptions.append(Interruption(t=noticed, cause=self.lost_cause, resumed=False))
                    return False
                await asyncio.sleep(min(1.0, self.opts.poll_interval_s * 2))
                continue
            after = round(time.monotonic() - began, 3)
            self.interruptions.append(
                Interruption(t=noticed, cause=cause or "device", resumed=True, after_s=after, app_running=app_pid != 0)
            )
            if self.opts.on_event is not None:
                running = "running" if app_pid else "not running"
                self.opts.on_event(f"{cause} came back after {after:g} s; the app is {running}")
            return True


async def _call(awaitable: Awaitable[T], what: str, timeout_s: float = CALL_TIMEOUT_S) -> T:
    """One call to the phone, bounded: a tunnel whose transport died may leave a reply pending forever."""
    try:
        return await bounded(awaitable, timeout_s)
    except TimeoutError:
        raise DeviceLostError(f"{what}: the phone did not answer within {timeout_s:g} s") from None


async def _pull_new_reports(
    device: Device, before: set[str], out_dir: Path, process: str, *, wait_s: float
) -> tuple[list[Path], list[Path], list[str]]:
    """JetsamEvent reports and the app's own crash reports filed since `before`, pulled into out_dir, and the
    ones that could not be pulled with why.

    The kernel files the report shortly after the kill, so an app that died without an end record gets
    `wait_s` seconds for its report to appear; the pulls then get CALL_TIMEOUT_S between them."""
    deadline = time.monotonic() + wait_s
    while True:
        await _call(crash.flush(device), "flushing crash reports")
        new = crash.filed_since(await _call(crash.list_reports(device), "listing crash reports"), before)
        jetsam = [p for p in new if crash.JETSAM_PATTERN.match(os.path.basename(p))]
        own = [p for p in new if os.path.basename(p).startswith(f"{process}-")]
        if jetsam or own or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)
    pulls_end = time.monotonic() + CALL_TIMEOUT_S
    kills = await crash.pull_reports(device, jetsam, out_dir, timeout_s=CALL_TIMEOUT_S)
    crashes = await crash.pull_reports(device, own, out_dir, timeout_s=max(1.0, pulls_end - time.monotonic()))
    return kills.pulled, crashes.pulled, kills.skipped + crashes.skipped


def claim_soak_output(out: Path) -> None:
    """Checks, before the phone is reached, that `out` can take a soak: a folder that can be made and holds no
    soak's results (a second run never overwrites the first). A soak that stopped before its first step (the app
    not installed, a backend it cannot run) measured nothing: its record is replaced, so the same command can be
    run again once the cause is fixed."""
    if ((out / RESULTS_FILE).exists() or (out / SOAKPLAN_FILE).exists()) and not _never_started(out):
        raise SoakOutputExistsError(
            f"{out}: holds a soak's results already ({RESULTS_FILE}); give another -o folder, or move them first"
        )
    make_folder(out)


def _never_started(out: Path) -> bool:
    """True when `out` holds only the soak plan and a results.json whose one run stopped before its first step
    (and the Finder's .DS_Store, which a Mac drops into any folder it shows)."""
    try:
        if {p.name for p in out.iterdir()} - {RESULTS_FILE, SOAKPLAN_FILE, ".DS_Store"}:
            return False
        runs = ResultsFile.model_validate_json((out / RESULTS_FILE).read_bytes()).runs
    except (OSError, ValueError):  # unlistable, unreadable or not ours: not a record to replace
        return False
    return len(runs) == 1 and runs[0].outcome is None and not runs[0].steps_done


async def soak(
    app_bundle_id: str,
    plan: SoakPlan,
    out_dir: str | Path,
    *,
    udid: str | None = None,
    options: SoakOptions | None = None,
    usbmux_address: str | None = None,
) -> SoakResult:
    """Opens a session to the selected device (preflight, then the tunnel on iOS 17+) and runs one soak (what
    `kvrig soak` calls). A failed preflight raises its typed error before anything is written."""

    opts = options or SoakOptions()
    out = Path(out_dir)
    made = [] if out.exists() else [out, *(p for p in out.parents if not p.exists())]
    claim_soak_output(out)
    try:
        async with open_session(
            udid, tunnel=opts.tunnel, usbmux_address=usbmux_address, handshake_timeout_s=opts.handshake_timeout_s
        ) as device:
            if opts.on_event is not None and device.tunnel is not None:
                opts.on_event(f"{device.udid}: tunnel {device.tunnel.kind} ({device.tunnel.plan.reason})")
            return await run_soak(device, app_bundle_id, plan, out_dir, opts)
    except BaseException:
        for folder in made:  # no phone reached: leave no empty folder behind
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
