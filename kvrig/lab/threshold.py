"""One lab run on one phone: the main soak, then, after a jetsam, the threshold search that re-runs the plan
up to the last context that survived until it survives `threshold.confirm_runs` times (which marks
`max_safe_context_confirmed`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrig.device.discovery import Device
from kvrig.exceptions import DeviceLostError, DeviceNotFoundError, KvrigError
from kvrig.lab.model import Event, LabRun
from kvrig.lab.save import read_partial, relocate
from kvrig.schemas.lab import Lab
from kvrig.schemas.results import JETSAM_OUTCOMES, Confirmation, SoakResult
from kvrig.soaking.driver import SoakOptions, run_soak
from kvrig.soaking.plan import make_plan


@dataclass
class Bench:
    """Where one phone's runs happen: the lab, the output folder, who hears progress, who saves."""

    lab: Lab
    out: Path
    say: Event
    saved: Callable[[LabRun], None]  # called with a run whose result changed


async def measure(bench: Bench, device: Device, run: LabRun, tag: str) -> None:
    """The main run, then the threshold search after a jetsam."""
    folder = f"{run.folder}/main"
    try:
        main = await soak(bench, device, run, run.entry.soak.max_tokens, run.result.run_id, folder, tag)
    except KvrigError:
        partial = read_partial(bench.out / folder)
        if partial is not None:  # what the driver saved before the step failed
            relocate(partial, folder)
            partial.entry = run.entry.label
            partial.device = run.result.device
            run.result = partial
        raise
    run.result = main
    threshold = bench.lab.threshold
    if main.outcome not in JETSAM_OUTCOMES or threshold.confirm_runs == 0 or not main.max_safe_context:
        return
    target, survived = main.max_safe_context, 0
    for attempt in range(1, threshold.max_attempts + 1):
        folder = f"{run.folder}/confirm-{attempt}"
        run_id = f"{main.run_id}-c{attempt}"
        try:
            confirm = await soak(bench, device, run, target, run_id, folder, tag)
        except KvrigError as exc:
            lost = isinstance(exc, DeviceLostError | DeviceNotFoundError)
            main.confirmations.append(
                Confirmation(run_id=run_id, max_tokens=target, outcome="device_lost" if lost else None, folder=folder)
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
        elif confirm.outcome in JETSAM_OUTCOMES and confirm.max_safe_context:
            target, survived = confirm.max_safe_context, 0  # killed below the first run's threshold
        elif confirm.outcome in JETSAM_OUTCOMES:
            # killed before its first step: the phone did not hold the first run's context again, so that figure
            # is not kept as if it stood
            main.outcome_detail = (
                f"{main.outcome_detail}; confirmation {attempt} was killed before its first step, so the first "
                f"run's {target} tokens are not kept"
            )
            target = 0
            break
        else:
            break  # crashed, hung or lost: stop searching, the figure stays unconfirmed
        bench.saved(run)
    main.max_safe_context = target
    main.max_safe_context_confirmed = survived >= threshold.confirm_runs


async def soak(
    bench: Bench, device: Device, run: LabRun, max_tokens: int, run_id: str, folder: str, tag: str
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
        backend=run.entry.backend,
        weights_residency=run.residency,
        on_critical=bench.lab.on_critical_for(run.entry),
    )
    t = bench.lab.timeouts
    options = SoakOptions(
        poll_interval_s=t.poll_interval_s,
        hang_after_s=t.hang_after_s,
        timeout_s=t.run_s,
        reconnect_s=t.reconnect_s,
        report_wait_s=t.report_wait_s,
        bundle=run.entry.bundle_name,
        extra_arguments=tuple(run.scheme.arguments),
        predicted=run.result.predicted,
        on_event=lambda line: bench.say(f"{tag}: {line}"),
    )
    result = await run_soak(device, run.entry.app_id, plan, bench.out / folder, options)
    relocate(result, folder)
    result.entry = run.entry.label
    result.device = run.result.device  # the lab's view of the phone (with its host)
    return result
