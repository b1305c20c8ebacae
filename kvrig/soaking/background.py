"""The background step of a soak (`kvrig soak --background prefill,decode`): send the app away mid-run and say
what came of it.

For each phase asked for, once the app has written a new step record: for `prefill` at once (the app starts the
next step's prefill as soon as it wrote the last), for `decode` after that step's prefill time again (the app's
own prefill rate times the step), launch another app through process control (Settings, on every iPhone), as a
person switching apps would, which puts the soaked app in the background; wait `away_s`; then bring the app back
(launching it again without killing it), if it still runs. The virtual iPhone does the same with its own apps
(`kvrig.virtual.background`).

After the run each step is judged from what the app and the phone left: the app's `scene` record (where it stopped
its GPU work, or that a continued-processing task let it go on), its end record (`background_task_expired`:
it ended cleanly), records written after it came back (`resumed`), or its death in the background with the
crash report (or device log) naming Metal's "Insufficient Permission (to submit GPU work from background)"
(`killed_gpu_background`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from kvrig.device.discovery import Device
from kvrig.device.processes import Processes
from kvrig.exceptions import KvrigError
from kvrig.reports.telemetry import TelemetryRun
from kvrig.schemas.results import BackgroundStep
from kvrig.schemas.telemetry import EndEvent, SceneEvent, StepEvent

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")
OTHER_APP = "com.apple.Preferences"  # Settings: on every iPhone, launchable through process control
GPU_BACKGROUND_MARK = "Insufficient Permission (to submit GPU work from background)"
DECODE_MARGIN = 1.25  # aim a little past the estimated prefill
STEP_WAIT_S = 600.0  # the longest wait for the app's next step record before the step is given up


def parse_phases(text: str) -> tuple[Phase, ...]:
    """`prefill,decode` -> ("prefill", "decode"); ValueError naming what is not a phase."""
    phases = tuple(p.strip() for p in text.split(",") if p.strip())
    wrong = [p for p in phases if p not in PHASES]
    if wrong:
        raise ValueError(f"not a phase: {', '.join(wrong)} (expected prefill or decode)")
    return phases  # type: ignore[return-value]


class BackgroundSteps:
    """Runs beside the soak's watch; `judge` turns what it did and what the run left into BackgroundSteps."""

    def __init__(
        self,
        device: Device,
        bundle_id: str,
        telemetry: Path,
        run_id: str,
        phases: tuple[Phase, ...],
        away_s: float,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.device, self.bundle_id, self.telemetry, self.run_id = device, bundle_id, telemetry, run_id
        self.phases, self.away_s, self.on_event = phases, away_s, on_event
        self.steps = [BackgroundStep(requested=phase, result="not_sent") for phase in phases]
        self.task: asyncio.Task[None] | None = None
        self.pid = 0

    def start(self, pid: int) -> None:
        if self.phases:
            self.pid = pid
            self.task = asyncio.create_task(self._run(), name="kvrig-background")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KvrigError):
                await self.task
            self.task = None

    # --- during the run -------------------------------------------------------------------------------------

    def _records(self) -> list[dict]:
        records = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.telemetry.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("run_id") == self.run_id:
                        records.append(record)
        return records

    def _steps(self) -> list[dict]:
        return [r for r in self._records() if r.get("event") == "step"]

    async def _next_step(self, seen: int) -> list[dict] | None:
        """The step records once there is a new one (None: the run ended first)."""
        deadline = time.monotonic() + STEP_WAIT_S
        while time.monotonic() < deadline:
            steps = self._steps()
            if len(steps) > seen:
                return steps
            if any(r.get("event") == "end" for r in self._records()):
                return None
            await asyncio.sleep(0.05)
        return None

    async def _run(self) -> None:
        seen = len(self._steps())
        for step in self.steps:
            steps = await self._next_step(seen)
            if steps is None:
                step.evidence = "the run ended (or wrote no new step) before the app could be sent away"
                return
            last = steps[-1]
            if step.requested == "decode":
                prefill = _prefill_seconds(steps)
                if prefill is None:
                    step.evidence = "the app's steps carry no prefill rate, so decode could not be aimed at"
                else:
                    await asyncio.sleep(prefill * DECODE_MARGIN)
            step.context_tokens = int(last.get("context_tokens") or 0)
            async with Processes(self.device) as processes:
                step.sent = time.time()
                await processes.launch(OTHER_APP, kill_existing=False)
                self._say(f"sent {self.bundle_id} to the background ({step.requested}): launched {OTHER_APP}")
                await asyncio.sleep(self.away_s)
                if await processes.pid_for(self.bundle_id) == self.pid:
                    await processes.launch(self.bundle_id, kill_existing=False)  # back to the foreground
                    step.returned = time.time()
                    self._say(f"brought {self.bundle_id} back after {self.away_s:g} s")
                else:
                    self._say(f"{self.bundle_id} is gone after {self.away_s:g} s in the background")
                    return
            seen = len(self._steps())

    def _say(self, text: str) -> None:
        if self.on_event is not None:
            self.on_event(text)

    # --- after the run ----------------------------------------------------------------------------------------

    def judge(
        self, run: TelemetryRun | None, crash_reports: list[Path], *, died: bool, gpu_in_log: bool = False
    ) -> list[BackgroundStep]:
        """`gpu_in_log`: the run ended as gpu_background on the device log's word (soaking.analyse)."""
        events = run.events if run is not None else []
        report = next((p for p in crash_reports if GPU_BACKGROUND_MARK in _text(p)), None)
        sent_steps = [s for s in self.steps if s.sent is not None]
        for index, step in enumerate(sent_steps):
            assert step.sent is not None
            until = sent_steps[index + 1].sent if index + 1 < len(sent_steps) else None
            window = [e for e in events if e.t >= step.sent - 0.05 and (until is None or e.t < until)]
            away = next((e for e in window if isinstance(e, SceneEvent) and e.phase == "background"), None)
            if away is not None:
                step.during = away.during
                step.gpu = "continued" if away.gpu == "continued" else "paused"
            end = next((e for e in window if isinstance(e, EndEvent)), None)
            back = step.returned
            later = [e for e in window if isinstance(e, StepEvent | SceneEvent) and back is not None and e.t >= back]
            said = f"the app's scene record: {away.gpu} before {away.during}" if away else "no scene record"
            if end is not None and end.reason == "background_task_expired":
                step.result = "ended_cleanly"
                step.evidence = f"{said}; end record background_task_expired at {end.context_tokens} tokens"
            elif later or (end is not None and back is not None and end.t >= back):
                step.result = "resumed"
                step.evidence = f"{said}; {len(later)} records after it came back"
            elif until is None and died and end is None:
                if report is not None or gpu_in_log:
                    where = f"{report.name}" if report is not None else "the device log"
                    step.result = "killed_gpu_background"
                    step.evidence = f"{said}; died in the background; {where}: {GPU_BACKGROUND_MARK}"
                else:
                    step.result = "killed"
                    step.evidence = f"{said}; died in the background without a GPU-from-background report"
            else:
                step.result = "unknown"
                step.evidence = f"{said}; nothing after it was sent away tells what happened"
        return self.steps


def _prefill_seconds(steps: list[dict]) -> float | None:
    """How long a step's prefill takes: the tokens each step added over its prefill rate, the quickest of the
    steps (a step the app spent partly in the background reports a slower rate)."""
    times = []
    before = 0
    for step in steps:
        context = int(step.get("context_tokens") or 0)
        rate = step.get("prefill_tps")
        if rate and context > before:
            times.append((context - before) / float(rate))
        before = context
    return min(times) if times else None


def _text(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")
    return ""
