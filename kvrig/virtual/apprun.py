"""Running launched apps as host processes, and playing the kernel for them.

A launched app is a host process in the app's data container: `python -m kvrig.virtual.llmlaunch` for apps
built with `kvrig build --virtual` (it runs the pushed bundle with real MLX), `kvrig.virtual.testapp`
otherwise (it grows memory the way the LLM app does, without a model). It speaks a JSON-line channel on its
stdin/stdout:

    app -> emulator   {"measure": {mlx_active_bytes, mlx_cache_bytes, mlx_peak_bytes, kv_bytes, weight_bytes,
                                   context_tokens, phone_format_delta_bytes, phone_format_peak_delta_bytes,
                                   mapped_weight_bytes}}
                      {"log": "text"}                      (goes to the device log under the app's name)
    emulator -> app   {"footprint": n, "available": n, "pressure": "normal|warning|critical"}

An app measures after every step (a forward pass, a cache conversion). `mlx_peak_bytes` is MLX's peak
memory since the previous measurement (`mx.get_peak_memory()`, then `mx.reset_peak_memory()`; Swift:
`Memory.peakMemory`, then `Memory.peakMemory = 0`), so the kernel charges the peak within each step, as iOS
charges every page when it is touched. The two `phone_format_*` deltas (default 0) are what an app running
in another format than the phone's adds to its active and peak bytes to get the phone's (see
`kvrig.virtual.llm_memory`); the Swift engine runs in the phone's format and sends neither.
`mapped_weight_bytes` (default 0) are the weights the app maps read-only from the bundle's file, as the phone
holds them: counted in its MLX numbers, charged to no footprint (see `kvrig.virtual.footprint`). All fields
are optional integers; unknown ones are ignored. `footprint` in the reply is the footprint at the
measurement (what the app's own phys_footprint query would return); see `kvrig.virtual.footprint`.

The emulator answers each measurement only if the app survives it: when the step's peak crosses the limit
it SIGKILLs the process and writes a JetsamEvent report showing the footprint at the page that crossed it;
the faults that end an app (crash, hang, GPU from the background, watchdog, vanish) fire here too.

An app runs under the limit iOS gives it (`VirtualDevice.app_limit_bytes`): the profile's entitled limit when its
entitlements include increased-memory-limit, else the default; the log line, the kill and the report follow it.

The device log reads as a real phone's: runningboardd states the app's memory limits at launch
(`[KVSoak:812] Memory Limits: active 160 inactive 160`, MiB), and a jetsam kill is told by the kernel
(`memorystatus: KVSoak [812] exceeded mem limit: ActiveHard 160 MB (fatal)`, then `killing_specific_process`),
SpringBoard and ReportSystemMemory, in the formats an iPadOS 26 log shows (kvrig.reports.devicelog).

Foreground and background (`kvrig.virtual.background`): launching an app brings it to the foreground and sends
the one there to the background; the app hears `{"scene": ...}` on its channel, and a measurement it sends from
the background without a continued-processing task holding the GPU (after the one in flight) gets it aborted as
Metal aborts GPU work from the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvrig.virtual import swiftapp
from kvrig.virtual.background import IN_FLIGHT_MEASUREMENTS, supported_resources
from kvrig.virtual.faults import FaultPlan
from kvrig.virtual.footprint import FootprintAccount, Measurement, cpu_seconds, pressure_level
from kvrig.virtual.jetsam_report import (
    JetsamVictim,
    build_crash_report,
    build_report,
    priority_scale,
    write_report,
)
from kvrig.virtual.logbus import SyslogBus
from kvrig.virtual.state import SYSTEM_APPS, DeviceState, Identity

APP_RUNTIME = "kvrig.virtual.testapp"
MIB = 1024 * 1024
# Metal's abort as MLX prints it when the app submits GPU work from the background (mlx-swift#274, iOS < 26).
GPU_BACKGROUND_ABORT = (
    "libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command buffer execution "
    "failed: Insufficient Permission (to submit GPU work from background) "
    "(00000006:kIOGPUCommandBufferCallbackErrorBackgroundExecutionNotPermitted)"
)
# Host runtimes an installed app may ask for with Info.plist `KvrigVirtualRuntime` (see appgen.virtual_ipa).
# An allow-list: a value from an app's plist never names a module directly.
APP_RUNTIMES = {"test": APP_RUNTIME, "llm": "kvrig.virtual.llmlaunch"}
# Listener callbacks: (pid, exit code or None, crashing signal or None)
TerminationListener = Callable[[int, int | None, int | None], None]


class AppLaunchError(Exception):
    pass


@dataclass
class AppProcess:
    pid: int
    bundle_id: str
    name: str
    proc: asyncio.subprocess.Process
    account: FootprintAccount
    started: float = field(default_factory=time.time)
    outcome: str = "running"
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    scene: str = "active"  # "active" (in front) or "background"
    background_measures: int = 0  # measurements received since it was sent to the background
    gpu_task: bool = False  # a continued-processing task holds the GPU for it (iOS 26+, where supported)
    expiry: asyncio.Task[None] | None = None


class AppHost(Protocol):
    """What the app runner needs of its phone (the phone reads its faults at each use: tests swap them)."""

    state: DeviceState
    identity: Identity
    syslog: SyslogBus
    baseline_bytes: int
    background_gpu: bool  # the phone supports GPU work in a continued-processing task (where iOS 26+ has it)
    continued_task_s: float | None  # how long such a task may run in the background before it expires

    @property
    def faults(self) -> FaultPlan: ...

    def app_limit_bytes(self, entitlements: object) -> int: ...


class AppRunner:
    def __init__(self, device: AppHost, *, python: str | None = None) -> None:
        self.device = device
        self.python = python or sys.executable
        self.processes: dict[int, AppProcess] = {}
        self.finished: dict[int, AppProcess] = {}
        self.termination_listeners: set[TerminationListener] = set()
        self.foreground: str | None = None  # the bundle id in front (None: the home screen)
        self.system_running: dict[int, str] = {}  # system apps launched (no host process): pid -> bundle id
        self._system_pids = iter(range(400, 1000))

    def running(self) -> dict[int, str]:
        system = {pid: SYSTEM_APPS[bundle_id][1] for pid, bundle_id in self.system_running.items()}
        return system | {pid: p.name for pid, p in self.processes.items()}

    def pid_for_bundle(self, bundle_id: str) -> int:
        for pid, process in self.processes.items():
            if process.bundle_id == bundle_id:
                return pid
        for pid, system_id in self.system_running.items():
            if system_id == bundle_id:
                return pid
        return 0

    async def launch(
        self,
        bundle_id: str,
        *,
        arguments: list[str] | None = None,
        environment: dict[str, str] | None = None,
        kill_existing: bool = True,
        start_suspended: bool = False,
    ) -> int:
        state, ident = self.device.state, self.device.identity
        if bundle_id in SYSTEM_APPS:  # Settings and the like: no host process, but they take the foreground
            pid = self.pid_for_bundle(bundle_id) or next(self._system_pids)
            self.system_running[pid] = bundle_id
            self.device.syslog.emit("SpringBoard", f"Launching {bundle_id} pid {pid}")
            self._to_foreground(bundle_id)
            return pid
        record = state.user_apps().get(bundle_id)
        if record is None:
            raise AppLaunchError(f"The application {bundle_id} is not installed")
        existing = self.pid_for_bundle(bundle_id)
        if existing:
            if not kill_existing:
                self._to_foreground(bundle_id)
                return existing
            await self.kill_bundle(bundle_id)
        container = state.container(bundle_id)
        bundle = state.app_bundle(bundle_id)
        limit_bytes = self.device.app_limit_bytes(record.get("Entitlements"))
        source_root = str(Path(__file__).resolve().parents[2])  # the folder holding the kvrig package
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_root, env.get("PYTHONPATH")]))
        env.update({str(k): str(v) for k, v in (environment or {}).items()})
        env.update(
            {
                "HOME": str(container),
                "TMPDIR": str(container / "tmp"),
                "KVRIG_CONTAINER": str(container),
                "KVRIG_BUNDLE_PATH": str(bundle),
                "KVRIG_BUNDLE_ID": bundle_id,
                "KVRIG_PRODUCT_TYPE": ident.product_type,
                "KVRIG_OS_VERSION": ident.product_version,
                "KVRIG_LIMIT_BYTES": str(limit_bytes),
                "KVRIG_SUPPORTED_RESOURCES": supported_resources(ident, self.device.background_gpu),
            }
        )
        # The one spot that picks the app's command: the compiled Swift engine, or a Python runtime.
        runtime = str(record.get("KvrigVirtualRuntime", "test"))
        try:
            command = (
                swiftapp.command(arguments or [])
                if runtime == swiftapp.RUNTIME
                else [self.python, "-m", APP_RUNTIMES.get(runtime, APP_RUNTIME), *(arguments or [])]
            )
        except swiftapp.SwiftEngineMissingError as exc:
            raise AppLaunchError(str(exc)) from None
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=str(container),
            env=env,
            start_new_session=True,
        )
        name = str(record.get("CFBundleExecutable") or bundle_id.rsplit(".", 1)[-1])
        account = FootprintAccount(
            limit_bytes=limit_bytes, page_size=ident.page_size, baseline_bytes=self.device.baseline_bytes
        )
        process = AppProcess(proc.pid, bundle_id, name, proc, account)
        self.processes[proc.pid] = process
        if start_suspended:
            os.kill(proc.pid, signal.SIGSTOP)
        self.device.syslog.emit("SpringBoard", f"Launching {bundle_id} pid {proc.pid}")
        limit_mb = limit_bytes // MIB
        self.device.syslog.emit(
            "runningboardd", f"[{name}:{proc.pid}] Memory Limits: active {limit_mb} inactive {limit_mb}"
        )
        self._to_foreground(bundle_id)
        process.tasks = [
            asyncio.create_task(self._channel(process)),
            asyncio.create_task(self._stderr(process)),
            asyncio.create_task(self._reap(process)),
        ]
        return proc.pid

    # --- the app's channel -----------------------------------------------------------------------------

    async def _channel(self, process: AppProcess) -> None:
        assert process.proc.stdout is not None and process.proc.stdin is not None
        while True:
            raw = await process.proc.stdout.readline()
            if not raw:
                return
            try:
                message = json.loads(raw)
            except json.JSONDecodeError:
                self.device.syslog.emit(process.name, raw.decode(errors="replace").rstrip(), pid=process.pid)
                continue
            if "log" in message:
                self.device.syslog.emit(process.name, str(message["log"]), pid=process.pid)
            if isinstance(message.get("continued_processing"), dict):
                self._continued_processing(process, message["continued_processing"])
            if "measure" in message:
                reply = self._on_measure(process, Measurement.from_json(message["measure"]))
                if reply is not None:
                    with contextlib.suppress(ConnectionError, BrokenPipeError):
                        process.proc.stdin.write((json.dumps(reply) + "\n").encode())
                        await process.proc.stdin.drain()

    def _on_measure(self, process: AppProcess, m: Measurement) -> dict[str, Any] | None:
        faults = self.device.faults
        footprint = process.account.update(m)
        if process.scene == "background" and not process.gpu_task:
            process.background_measures += 1
            if process.background_measures > IN_FLIGHT_MEASUREMENTS:
                self._gpu_background(process)
                return None
        if faults.crash_at_tokens is not None and m.context_tokens >= faults.crash_at_tokens:
            self._crash(process)
            return None
        if faults.gpu_background_at_tokens is not None and m.context_tokens >= faults.gpu_background_at_tokens:
            self._gpu_background(process)
            return None
        if faults.watchdog_at_tokens is not None and m.context_tokens >= faults.watchdog_at_tokens:
            self._watchdog(process)
            return None
        if faults.vanish_at_tokens is not None and m.context_tokens >= faults.vanish_at_tokens:
            process.outcome = "vanished"  # SIGKILL and nothing else: no line, no report
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            return None
        if faults.hang_at_tokens is not None and m.context_tokens >= faults.hang_at_tokens:
            process.outcome = "hang"
            os.kill(process.pid, signal.SIGSTOP)
            self.device.syslog.emit("SpringBoard", f"{process.bundle_id} is not responding", level="error")
            return None
        if process.account.over_limit:
            self._jetsam(process)
            return None
        return {
            "footprint": footprint,
            "available": process.account.available_bytes,
            "pressure": pressure_level(footprint, process.account.limit_bytes),
        }

    def _jetsam(self, process: AppProcess) -> None:
        account = process.account
        process.outcome = "jetsam"
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        ident, log = self.device.identity, self.device.syslog
        band = 10 * priority_scale(ident.product_version)
        age_s = int(time.time() - process.started)
        log.emit(
            "kernel",
            f"memorystatus: {process.name} [{process.pid}] exceeded mem limit: ActiveHard "
            f"{account.limit_bytes // MIB} MB (fatal)",
        )
        log.emit(
            "kernel",
            f"memorystatus: killing_specific_process pid {process.pid} [{process.name}] "
            f"(per-process-limit {band} {age_s}s) {account.current_bytes // 1024}KB",
        )
        log.emit(
            "SpringBoard",
            f"[app<{process.bundle_id}>:{process.pid}] Process exited: domain:jetsam(1) code:per-process-limit(7)",
        )
        log.emit(
            "ReportSystemMemory", f"Process {process.name} [{process.pid}] killed by jetsam reason per-process-limit"
        )
        if self.device.faults.jetsam_without_report:
            return  # as for an app killed while suspended: the log tells it, no report is filed
        victim = JetsamVictim(
            pid=process.pid,
            name=process.name,
            rpages=account.rpages,
            lifetime_max_pages=account.lifetime_max_pages,
            uuid=str(uuid.uuid5(uuid.NAMESPACE_URL, process.bundle_id)).upper(),
            coalition=process.pid,
            age_s=time.time() - process.started,
            cpu_time_s=cpu_seconds(process.pid),
        )
        text = build_report(phone=self.device.identity, victim=victim)
        path = write_report(self.device.state.crash, text)
        self.device.syslog.emit(
            "osanalyticshelper",
            f"Saved type '298(JetsamEvent)' report (1 of max 25) at "
            f"/private/var/mobile/Library/Logs/CrashReporter/{path.name}",
        )

    def _crash(self, process: AppProcess) -> None:
        self._end_with_report(process, "crash", signal.SIGSEGV, signal="SIGSEGV")

    def _end_with_report(self, process: AppProcess, outcome: str, sig: int, **report: Any) -> None:
        """Ends the app with `sig` and files the crash report iOS writes for that kind of end."""
        process.outcome = outcome
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)
        text = build_crash_report(
            phone=self.device.identity, pid=process.pid, name=process.name, bundle_id=process.bundle_id, **report
        )
        stamp = time.strftime("%Y-%m-%d-%H%M%S", time.gmtime())
        (self.device.state.crash / f"{process.name}-{stamp}.ips").write_text(text)

    def _gpu_background(self, process: AppProcess) -> None:
        """Metal refuses a command buffer from the background; MLX's uncaught exception aborts the app."""
        self.device.syslog.emit(process.name, GPU_BACKGROUND_ABORT, pid=process.pid, level="error")
        self._end_with_report(process, "gpu_background", signal.SIGABRT, kind="abort", message=GPU_BACKGROUND_ABORT)

    def _watchdog(self, process: AppProcess) -> None:
        """FrontBoard's watchdog ends an app that overran its scene-update allowance: 0x8badf00d."""
        explanation = (
            f"scene-update watchdog transgression: {process.bundle_id} exhausted real (wall clock) time allowance "
            "of 10.00 seconds"
        )
        self.device.syslog.emit(
            "SpringBoard",
            f"[{process.bundle_id}] Executing termination for reason (none) with request: "
            f'<FBSProcessTerminationRequest: 0x{id(process) & 0xFFFFFFFFF:x}; label: "watchdog provision violated"; '
            f'exceptionCode: "Watchdog Violation (0x8BADF00D)"; reportType: CrashLog; explanation: "{explanation}">',
        )
        self._end_with_report(process, "watchdog", signal.SIGKILL, kind="watchdog")

    # --- foreground and background (kvrig.virtual.background) -----------------------------------------------

    def _to_foreground(self, bundle_id: str) -> None:
        previous, self.foreground = self.foreground, bundle_id
        for process in list(self.processes.values()):
            if process.bundle_id == bundle_id and process.scene != "active":
                self._set_scene(process, "active")
            elif process.bundle_id == previous and previous != bundle_id:
                self._set_scene(process, "background")

    def _set_scene(self, process: AppProcess, scene: str) -> None:
        process.scene, process.background_measures = scene, 0
        self.device.syslog.emit("SpringBoard", f"{process.bundle_id} pid {process.pid} scene {scene}")
        self._tell(process, {"scene": scene})
        if process.expiry is not None:
            process.expiry.cancel()
            process.expiry = None
        seconds = self.device.continued_task_s
        if scene == "background" and process.gpu_task and seconds is not None:
            process.expiry = asyncio.ensure_future(self._expire(process, seconds))

    async def _expire(self, process: AppProcess, seconds: float) -> None:
        await asyncio.sleep(seconds)
        process.gpu_task = False
        self.device.syslog.emit(
            "dasd", f"{process.bundle_id}: continued-processing task expired after {seconds:g} s in the background"
        )
        self._tell(process, {"continued_processing": "expired"})

    def _continued_processing(self, process: AppProcess, request: dict[str, Any]) -> None:
        """A BGContinuedProcessingTaskRequest the app submitted: the GPU only where the phone supports it."""
        wants_gpu = bool(request.get("gpu"))
        supported = supported_resources(self.device.identity, self.device.background_gpu) == "gpu"
        process.gpu_task = wants_gpu and supported
        granted = "with the GPU" if process.gpu_task else "without the GPU"
        self.device.syslog.emit("dasd", f"{process.bundle_id}: continued-processing task running {granted}")

    def _tell(self, process: AppProcess, message: dict[str, Any]) -> None:
        stdin = process.proc.stdin
        if stdin is None or stdin.is_closing():
            return
        with contextlib.suppress(ConnectionError, BrokenPipeError, RuntimeError):
            stdin.write((json.dumps(message) + "\n").encode())

    async def _stderr(self, process: AppProcess) -> None:
        assert process.proc.stderr is not None
        while True:
            raw = await process.proc.stderr.readline()
            if not raw:
                return
            self.device.syslog.emit(process.name, raw.decode(errors="replace").rstrip(), pid=process.pid)

    async def _reap(self, process: AppProcess) -> None:
        code = await process.proc.wait()
        if process.expiry is not None:
            process.expiry.cancel()
        if self.foreground == process.bundle_id:
            self.foreground = None  # back to the home screen
        self.processes.pop(process.pid, None)
        self.finished[process.pid] = process
        exit_code, crash_signal = (code, None) if code >= 0 else (None, -code)
        if process.outcome == "running":
            process.outcome = f"exited {exit_code}" if crash_signal is None else f"signal {crash_signal}"
        self.device.syslog.emit(
            "SpringBoard", f"{process.bundle_id} pid {process.pid} ended: {process.outcome}", level="info"
        )
        for listener in list(self.termination_listeners):
            listener(process.pid, exit_code, crash_signal)

    # --- control ---------------------------------------------------------------------------------------

    def signal(self, pid: int, sig: int) -> None:
        if pid in self.system_running:  # a system app: no process to signal; it just leaves
            bundle_id = self.system_running.pop(pid)
            if sig in (signal.SIGKILL, signal.SIGTERM) and self.foreground == bundle_id:
                self.foreground = None
            return
        process = self.processes.get(pid)
        if process is None:
            raise ProcessLookupError(pid)
        if sig == signal.SIGKILL:
            process.outcome = "killed"
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        os.kill(pid, sig)

    async def wait(self, pid: int, timeout: float | None = None) -> AppProcess:
        process = self.processes.get(pid) or self.finished.get(pid)
        if process is None:
            raise ProcessLookupError(pid)
        await asyncio.wait_for(asyncio.shield(process.tasks[2]), timeout)
        return process

    async def kill_bundle(self, bundle_id: str) -> None:
        pid = self.pid_for_bundle(bundle_id)
        if pid:
            self.signal(pid, signal.SIGKILL)
            await self.wait(pid, 10)

    async def kill_all(self) -> None:
        for pid in list(self.processes):
            with contextlib.suppress(ProcessLookupError):
                self.signal(pid, signal.SIGKILL)
        for process in list(self.processes.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(process.proc.wait(), 10)
            for task in process.tasks:
                task.cancel()
