"""The device lab: a matrix of app × bundle × scheme soaked on every selected phone, as CI.

Phones run in parallel (one asyncio task each); the runs on one phone run one after another. After a jetsam
the threshold search re-runs the plan up to the last context that survived until it survives
`threshold.confirm_runs` times, which marks `max_safe_context_confirmed`. The planner's prediction is attached
when the entry names a model and the phone's profile is known; gates are evaluated per run.

`results.json` and `junit.xml` in the output folder are rewritten after every run, so a lab that dies half-way
leaves what it learned (runs not started yet have no outcome and show as skipped). `report.html` is written
at the end (`kvrig lab report` renders it again from results.json).

Layout: OUT/results.json, OUT/junit.xml, OUT/report.html, OUT/report/*.png,
OUT/runs/<udid>/<entry>/<scheme>/{main,confirm-N}/ (each a soak output folder).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import toolchain
from toolchain import gates as gate_checks
from toolchain.device.discovery import Device, DeviceInfo, connect, list_devices
from toolchain.exceptions import DeviceLostError, DeviceNotFoundError, KvrigError, LabError, SchemaError
from toolchain.schemas import load_model_file
from toolchain.schemas.lab import ANY_DEVICE, Lab, LabDevice, MatrixEntry, SchemeSpec, slug
from toolchain.schemas.results import (
    RESULTS_FILE,
    Confirmation,
    DeviceRef,
    Prediction,
    ResultsFile,
    SoakFiles,
    SoakResult,
)
from toolchain.soak import SoakOptions, make_plan, run_soak

JUNIT_FILE = "junit.xml"
RUNS_DIR = "runs"

Event = Callable[[str], None]


@dataclass
class LabRun:
    """One device × entry × scheme: its final result (the main run, narrowed by the threshold search)."""

    entry: MatrixEntry
    scheme: SchemeSpec
    folder: str  # relative to the output folder
    result: SoakResult


@dataclass
class LabResults:
    lab: Lab
    out_dir: Path
    runs: list[LabRun]
    notes: list[str] = field(default_factory=list)

    @property
    def results(self) -> ResultsFile:
        return ResultsFile(tool_version=toolchain.__version__, runs=[r.result for r in self.runs])

    @property
    def failed(self) -> list[LabRun]:
        """Runs CI fails on: a bad outcome, a failed gate, or a run that could not be made."""
        return [r for r in self.runs if gate_checks.failures(r.result) or r.result.outcome is None]

    @property
    def ran(self) -> list[LabRun]:
        return [r for r in self.runs if r.result.outcome is not None]

    @property
    def passed(self) -> bool:
        return bool(self.runs) and not self.failed


# --- selecting phones --------------------------------------------------------------------------------------


@dataclass
class _Target:
    udid: str
    spec: LabDevice
    info: DeviceInfo | None
    problem: str | None = None  # why its runs cannot be made


def _profile_name(ref: str) -> str:
    from toolchain.profiles import load_profile

    return load_profile(ref).name


def select_targets(lab: Lab, attached: list[DeviceInfo]) -> list[_Target]:
    """The lab's devices matched against the attached ones: listed UDIDs (attached or not, so a missing phone
    shows up in the results), then every other attached phone for each `any` entry."""
    by_udid = {d.udid: d for d in attached}
    listed = {d.udid for d in lab.devices if d.udid != ANY_DEVICE}
    targets: list[_Target] = []
    taken: set[str] = set()
    for spec in lab.devices:
        expected = _profile_name(spec.profile) if spec.profile else None
        if spec.udid != ANY_DEVICE:
            info = by_udid.get(spec.udid)
            problem = None
            if info is None:
                problem = f"device {spec.udid} is not attached"
            elif info.error:
                problem = info.error
            elif expected and info.profile != expected:
                problem = f"expected profile {expected}, the device ({info.product_type}) maps to {info.profile}"
            targets.append(_Target(spec.udid, spec, info, problem))
            taken.add(spec.udid)
            continue
        for info in attached:
            if info.udid in listed or info.udid in taken:
                continue
            if expected and info.profile != expected:
                continue
            targets.append(_Target(info.udid, spec, info, info.error))
            taken.add(info.udid)
    return targets


# --- predictions -------------------------------------------------------------------------------------------


class _Predictor:
    """Planner predictions per (model, profile, limit, plan options, scheme); MLX is imported only here."""

    def __init__(self, notes: list[str]) -> None:
        self.notes = notes
        self.unavailable = False
        self._cache: dict[tuple[str, ...], Prediction | None] = {}

    def predict(
        self, entry: MatrixEntry, scheme: SchemeSpec, profile: str | None, device: LabDevice
    ) -> Prediction | None:
        source = entry.model_source
        if source is None or profile is None or self.unavailable:
            return None
        from toolchain.exceptions import QuantizationError
        from toolchain.plan.kv import parse_scheme

        try:
            planner_scheme = parse_scheme(scheme.plan_scheme or scheme.name).name
        except QuantizationError:
            if scheme.plan_scheme is not None:
                raise SchemaError(
                    f"'{scheme.plan_scheme}' is not a KV scheme the planner knows",
                    field=f"matrix.{entry.label}.schemes.{scheme.name}.plan_scheme",
                    expected="fp16, bf16 or kXvY such as k8v4",
                ) from None
            note = f"{entry.label}/{scheme.name}: no prediction (not a planner scheme; set plan_scheme)"
            if note not in self.notes:
                self.notes.append(note)
            return None
        key: tuple[str, ...] = (str(source), profile, str(device.limit_bytes), str(device.baseline_bytes))
        key += (entry.plan.model_dump_json(), planner_scheme)
        if key not in self._cache:
            self._cache[key] = self._plan(source, profile, device, entry, planner_scheme)
        return self._cache[key]

    def _plan(
        self, source: Path, profile_ref: str, device: LabDevice, entry: MatrixEntry, scheme: str
    ) -> Prediction | None:
        try:
            from toolchain.models import load_model_spec
            from toolchain.plan import plan_memory
            from toolchain.profiles import AppMemoryLimit, SourcedInt, load_profile

            profile = load_profile(profile_ref)
            # A phone whose limit or baseline the lab knows better than the profile (a virtual iPhone).
            if device.limit_bytes is not None:
                given = SourcedInt(value=device.limit_bytes, basis="reported", source="lab file: limit_bytes")
                profile = profile.model_copy(update={"app_memory_limit": AppMemoryLimit(default_bytes=given)})
            if device.baseline_bytes is not None:
                given = SourcedInt(value=device.baseline_bytes, basis="reported", source="lab file: baseline_bytes")
                profile = profile.model_copy(update={"app_baseline_bytes": given})
            opts = entry.plan
            plan = plan_memory(
                load_model_spec(source),
                profile,
                schemes=[scheme],
                weights=opts.weights,
                margin=opts.margin,
                limit=opts.limit,
                prefill_step=opts.prefill_step,
                contexts=[1024],
            )
        except ImportError as exc:  # no MLX on this machine: the lab still runs, without predictions
            self.unavailable = True
            self.notes.append(f"no predictions: the planner needs MLX ({exc})")
            return None
        return Prediction(
            max_context=plan.max_context[scheme],
            limit_bytes=plan.limit_bytes,
            footprint_at_max_context_bytes=plan.budget_at_max_context[scheme].total_bytes,
        )


# --- the lab -----------------------------------------------------------------------------------------------


class _LabRunner:
    def __init__(self, lab: Lab, out: Path, on_event: Event | None, usbmux_address: str | None) -> None:
        self.lab, self.out, self.on_event, self.usbmux_address = lab, out, on_event, usbmux_address
        self.results = LabResults(lab, out, [])
        self.stamp = time.strftime("%Y%m%d-%H%M%S")

    def say(self, line: str) -> None:
        if self.on_event is not None:
            self.on_event(line)

    def save(self) -> None:
        from toolchain.junit import write_junit

        for run in self.results.runs:
            gates = self.lab.gates.merged(run.entry.gates)
            run.result.gates = gate_checks.evaluate(run.result, gates) if run.result.outcome is not None else []
        data = self.results.results.model_dump(mode="json", by_alias=True)
        _atomic_write(self.out / RESULTS_FILE, json.dumps(data, indent=2) + "\n")
        write_junit(self.results.results, self.out / JUNIT_FILE, name=self.lab.name)

    def plan_runs(self, targets: list[_Target]) -> dict[str, list[LabRun]]:
        predictor = _Predictor(self.results.notes)
        per_device: dict[str, list[LabRun]] = {}
        for target in targets:
            info = target.info
            ref = DeviceRef(
                udid=target.udid,
                product_type=info.product_type if info else None,
                os_version=info.os_version if info else None,
                profile=info.profile if info else None,
            )
            runs = per_device.setdefault(target.udid, [])
            for entry in self.lab.matrix:
                for scheme in entry.schemes:
                    folder = f"{RUNS_DIR}/{slug(target.udid)}/{slug(entry.label)}/{slug(scheme.name)}"
                    run_id = "-".join(slug(p) for p in (entry.label, scheme.name, target.udid[:8], self.stamp))
                    predicted = None
                    if target.problem is None:
                        predicted = predictor.predict(entry, scheme, ref.profile, target.spec)
                    result = SoakResult(
                        run_id=run_id,
                        device=ref,
                        app_id=entry.app_id,
                        bundle=entry.bundle_name,
                        scheme=scheme.name,
                        entry=entry.label,
                        predicted=predicted,
                    )
                    if target.problem is not None:
                        result.error = f"device: {target.problem}"
                    runs.append(LabRun(entry, scheme, folder, result))
        self.results.runs = [r for runs in per_device.values() for r in runs]
        return per_device

    async def run(self) -> LabResults:
        attached = await list_devices(usbmux_address=self.usbmux_address)
        targets = select_targets(self.lab, attached)
        per_device = self.plan_runs(targets)
        self.save()
        if not targets:
            seen = ", ".join(f"{d.udid} ({d.profile})" for d in attached) or "none"
            raise LabError(f"no attached device matches the lab's devices (attached: {seen})")
        ready = [t for t in targets if t.problem is None]
        for t in targets:
            if t.problem is not None:
                self.say(f"{t.udid}: {t.problem}; its runs are not made")
        await asyncio.gather(*(self.device_task(t, per_device[t.udid]) for t in ready))
        self.save()
        return self.results

    async def device_task(self, target: _Target, runs: list[LabRun]) -> None:
        tag = target.udid[:8]
        try:
            device = await connect(target.udid, usbmux_address=self.usbmux_address)
        except KvrigError as exc:
            for run in runs:
                self._not_run(run, exc)
            self.save()
            return
        async with device:
            prepared: set[str] = set()
            lost: KvrigError | None = None
            for run in runs:
                if lost is not None and not await _came_back(device):
                    self._not_run(run, lost, earlier=True)
                    self.save()
                    continue
                lost = None
                self.say(f"{tag}: {run.entry.label} / {run.scheme.name}")
                try:
                    if run.entry.label not in prepared:
                        await self.prepare(device, run.entry)
                        prepared.add(run.entry.label)
                    await self.measure(device, run, tag)
                except (DeviceLostError, DeviceNotFoundError) as exc:
                    lost = exc
                    self._not_run(run, exc)
                except KvrigError as exc:
                    run.result.error = run.result.error or str(exc)
                    self.say(f"{tag}: {run.entry.label} / {run.scheme.name}: error: {exc}")
                if run.result.outcome == "device_lost" or any(
                    c.outcome == "device_lost" for c in run.result.confirmations
                ):
                    lost = lost or DeviceLostError(f"device {target.udid} went away")
                self.say(f"{tag}: {_summary(run.result)}")
                self.save()

    async def prepare(self, device: Device, entry: MatrixEntry) -> None:
        """Installs the entry's app and pushes its bundle (once per device)."""
        from toolchain.device import apps, files

        if entry.ipa is not None:
            await apps.install(device, entry.ipa)
        if entry.bundle_path is not None:
            await files.push_bundle(device, entry.app_id, entry.bundle_path)

    async def measure(self, device: Device, run: LabRun, tag: str) -> None:
        """The main run, then the threshold search after a jetsam."""
        schedule = run.entry.soak
        folder = f"{run.folder}/main"
        try:
            main = await self.soak(device, run, schedule.max_tokens, run.result.run_id, folder, tag)
        except KvrigError:
            partial = _read_partial(self.out / folder)
            if partial is not None:  # what the driver saved before the step failed
                _relocate(partial, folder)
                partial.entry = run.entry.label
                run.result = partial
            raise
        run.result = main
        threshold = self.lab.threshold
        if main.outcome != "jetsam" or threshold.confirm_runs == 0 or not main.max_safe_context:
            return
        target, survived = main.max_safe_context, 0
        for attempt in range(1, threshold.max_attempts + 1):
            folder = f"{run.folder}/confirm-{attempt}"
            run_id = f"{main.run_id}-c{attempt}"
            try:
                confirm = await self.soak(device, run, target, run_id, folder, tag)
            except KvrigError as exc:
                lost = isinstance(exc, DeviceLostError | DeviceNotFoundError)
                main.confirmations.append(
                    Confirmation(
                        run_id=run_id, max_tokens=target, outcome="device_lost" if lost else None, folder=folder
                    )
                )
                main.outcome_detail = f"{main.outcome_detail}; confirmation {attempt} failed: {exc}"
                break
            main.confirmations.append(
                Confirmation(
                    run_id=run_id,
                    max_tokens=target,
                    outcome=confirm.outcome,
                    max_context_reached=confirm.max_context_reached,
                    folder=folder,
                )
            )
            if confirm.outcome == "completed" and (confirm.max_context_reached or 0) >= target:
                survived += 1
                if survived >= threshold.confirm_runs:
                    break
            elif confirm.outcome == "jetsam" and confirm.max_safe_context:
                target, survived = confirm.max_safe_context, 0  # killed below the first run's threshold
            else:
                break  # crashed, hung, lost, or killed before its first step: stop searching
            self.save()
        main.max_safe_context = target
        main.max_safe_context_confirmed = survived >= threshold.confirm_runs

    async def soak(
        self, device: Device, run: LabRun, max_tokens: int, run_id: str, folder: str, tag: str
    ) -> SoakResult:
        s = run.entry.soak
        start = min(s.start_tokens or s.step_tokens, max_tokens)
        plan = make_plan(
            max_tokens=max_tokens,
            step_tokens=s.step_tokens,
            start_tokens=start,
            decode_tokens=s.decode_tokens,
            scheme=run.scheme.name,
            run_id=run_id,
            max_seconds=s.max_seconds,
        )
        t = self.lab.timeouts
        options = SoakOptions(
            poll_interval_s=t.poll_interval_s,
            hang_after_s=t.hang_after_s,
            timeout_s=t.run_s,
            reconnect_s=t.reconnect_s,
            report_wait_s=t.report_wait_s,
            bundle=run.entry.bundle_name,
            extra_arguments=tuple(run.scheme.arguments),
            predicted=run.result.predicted,
            on_event=lambda line: self.say(f"{tag}: {line}"),
        )
        result = await run_soak(device, run.entry.app_id, plan, self.out / folder, options)
        _relocate(result, folder)
        result.entry = run.entry.label
        return result

    def _not_run(self, run: LabRun, exc: KvrigError, *, earlier: bool = False) -> None:
        r = run.result
        if isinstance(exc, DeviceLostError | DeviceNotFoundError):
            r.outcome = "device_lost"
            r.outcome_detail = (
                f"not run: the device was lost during an earlier run ({exc})" if earlier else f"device lost: {exc}"
            )
            r.finished = r.finished or time.time()
        else:
            r.error = r.error or str(exc)


async def _came_back(device: Device) -> bool:
    with contextlib.suppress(KvrigError):
        await device.reconnect()
        return True
    return False


def _read_partial(folder: Path) -> SoakResult | None:
    try:
        return load_model_file(ResultsFile, folder / RESULTS_FILE).runs[0]
    except (KvrigError, IndexError):
        return None


def _relocate(result: SoakResult, folder: str) -> None:
    """Soak file paths are relative to the soak's folder; the lab's results file sits above it."""
    f = result.files
    result.files = SoakFiles(
        telemetry=f"{folder}/{f.telemetry}" if f.telemetry else None,
        jetsam_reports=[f"{folder}/{p}" for p in f.jetsam_reports],
        crash_reports=[f"{folder}/{p}" for p in f.crash_reports],
    )


def _summary(r: SoakResult) -> str:
    confirmed = " confirmed" if r.max_safe_context_confirmed else ""
    outcome = r.outcome or f"no outcome ({r.error})"
    return f"{r.entry} / {r.scheme}: {outcome}, max safe context {r.max_safe_context}{confirmed}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def run_lab(
    lab: Lab, out_dir: str | Path, *, on_event: Event | None = None, usbmux_address: str | None = None
) -> LabResults:
    """Runs the lab on the attached phones; writes results.json, junit.xml and report.html into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runner = _LabRunner(lab, out, on_event, usbmux_address)
    results = await runner.run()
    from toolchain.report import write_report

    write_report(results.results, out, title=f"kvrig lab: {lab.name}")
    return results
