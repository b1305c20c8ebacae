"""The main job end to end on a virtual iPhone (what `kvrig demo` and `make demo` run).

Package the embedded SmolLM2 (weights and KV scheme as given), plan it, render its app and build the .ipa for
the virtual iPhone, start a virtual iPhone 15 Pro whose app limit is the plan's peak footprint at
`room_tokens` (weights, KV, MLX buffer cache, the prefill transient, the profile's baseline; so jetsam comes in
a minute or two on a laptop CPU), deploy the app and the bundle, soak until jetsam, and compare the planner's
prediction with what the soak measured and what the JetsamEvent report says. The virtual iPhone is stopped at
the end.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvrig.appgen.render import AppOptions, render_app
from kvrig.appgen.virtual_ipa import APP_RUNTIMES, build_virtual_ipa
from kvrig.bundle.options import PackageOptions
from kvrig.device.deploy import deploy
from kvrig.fileio import make_folder
from kvrig.models import load_model_spec
from kvrig.models.gguf import embedded_default_model
from kvrig.packaging import package
from kvrig.planner import PlanRequest, plan_memory
from kvrig.planner.memory import DEFAULT_MARGIN
from kvrig.profiles import AppMemoryLimit, SourcedInt, load_profile
from kvrig.quality.bench import Tally
from kvrig.schemas.bundle import MANIFEST_NAME
from kvrig.schemas.kvcache import PressurePolicy
from kvrig.schemas.results import JETSAM_OUTCOMES, Prediction, SoakResult
from kvrig.soaking.driver import SoakOptions, soak
from kvrig.soaking.plan import make_plan
from kvrig.virtual.host import EmulatorHost
from kvrig.virtual.swiftapp import buffer_cache_held, resolve_runtime

APP_NAME = "SmolLM2 Demo"
APP_ID = "dev.kvrig.demo"
Event = Callable[[str], None]


@dataclass(frozen=True)
class DemoOptions:
    out: Path
    device: str = "iPhone16,1"
    weights: str = "auto"
    kv: str = "auto"
    room_tokens: int = 2048
    prefill_step: int = 512
    step_tokens: int = 256
    decode_tokens: int = 4
    max_tokens: int = 16384
    max_seconds: float = 900.0
    ios: str = "18.6"
    app_runtime: str = "auto"
    """`auto` (the app's Swift engine when it can be built here, else the Python runtime), `swift`, `python`."""
    quality_gate: bool = True
    """Packaging measures the bundle against the quality gate (False: `kvrig package --no-quality-gate`, which
    needs a weight recipe: `auto` chooses by the gate). With a recipe given, the gate only checks it."""


@dataclass
class DemoResult:
    bundle: Path
    project: Path
    ipa: Path
    device: str
    limit_bytes: int
    predicted_max_context: int
    """Planner, no safety margin: the context whose estimated peak reaches the limit."""
    predicted_max_context_with_margin: int
    margin: float
    predicted_footprint_bytes: int
    soak: SoakResult
    soak_dir: Path
    kv: str = ""
    prefill_step: int = 0
    step_tokens: int = 0
    ios: str = ""
    app_runtime: str = ""
    """What the virtual iPhone ran: `swift` (the app's engine) or `python` (kvrig's LLM runtime)."""
    app_runtime_why: str = ""
    buffer_cache_bytes: int = 0
    """The buffer cache the plan counted: what the app's MLX keeps on this host, measured with the bundle's cap."""
    buffer_cache_limit_bytes: int = 0

    @property
    def killed_in_step(self) -> tuple[int, int] | None:
        """The soak step the kernel killed the app in: (last context it survived, the context it was growing
        to; 0 for a kill in the first step); None unless jetsam ended the run (with or without its report)."""
        if self.soak.outcome not in JETSAM_OUTCOMES:
            return None
        survived = self.soak.max_safe_context or 0
        return survived, survived + self.step_tokens

    @property
    def plan_within_one_step(self) -> bool | None:
        """The issue's check: the planned max context (no margin) lies within one soak step of the kill."""
        step = self.killed_in_step
        if step is None:
            return None
        return abs(self.predicted_max_context - step[0]) <= self.step_tokens

    @property
    def kill_footprint_over_limit_bytes(self) -> int | None:
        """The JetsamEvent report's footprint minus the limit (within one page when the kernel is exact)."""
        at_kill = self.soak.footprint_at_kill_bytes
        return None if at_kill is None else at_kill - self.limit_bytes


def _say(on_event: Event | None, text: str) -> None:
    if on_event is not None:
        on_event(text)


def run_demos(
    options: DemoOptions,
    kv: list[str],
    prefill_steps: list[int],
    on_event: Callable[[str, str], None] | None = None,
) -> list[DemoResult]:
    """`run_demo` for each KV spec × prefill step, in that order: one run in `options.out` itself, several each in
    its own folder under it (`<kv>-p<step>`). `on_event(tag, line)`: the run's `<kv>/p<step>` and its line."""
    combos = [(k, p) for k in kv for p in prefill_steps]
    results = []
    for scheme, step in combos:
        folder = options.out if len(combos) == 1 else options.out / f"{scheme}-p{step}"
        tag = f"{scheme}/p{step}"
        say = None if on_event is None else (lambda line, tag=tag: on_event(tag, line))
        results.append(run_demo(replace(options, out=folder, kv=scheme, prefill_step=step), on_event=say))
    return results


def run_demo(options: DemoOptions, on_event: Event | None = None) -> DemoResult:
    profile = load_profile(options.device)  # a wrong --device stops before minutes of packaging
    out = options.out
    make_folder(out, "the demo's folder")
    name = f"smollm2-{options.weights}-{options.kv}-p{options.prefill_step}"
    _say(on_event, f"packaging SmolLM2-135M ({options.weights} weights, {options.kv} KV) ...")
    bundle_dir = out / "bundles" / name
    if (bundle_dir / MANIFEST_NAME).is_file():
        shutil.rmtree(bundle_dir)  # the demo's own bundle from an earlier run: rebuilt, never forced past a check
    tally = Tally(lambda line: _say(on_event, line))  # a count of layers quantized, not a line each
    try:
        packaged = package(
            embedded_default_model(),
            bundle_dir,
            PackageOptions(
                weights=options.weights,
                kv=options.kv,
                prefill_step_size=options.prefill_step,
                quality_gate=options.quality_gate,
                # The demo measures where jetsam strikes: an app that evicted under pressure would move it.
                pressure=PressurePolicy(warning="none", critical="none"),
                progress=tally,
            ),
        )
    finally:
        tally.close()
    bundle, kv = packaged.path, packaged.kvcache
    # The KV spec in full: its sinks and recent window add float copies the plan counts, and the soak records it.
    scheme = kv.spec

    spec = load_model_spec(bundle)
    runtime = resolve_runtime(options.app_runtime, on_event)
    # The buffer cache the app's MLX really keeps on this host (measured; the bundle's cap is what Metal keeps).
    held_cache = buffer_cache_held(runtime.runtime, kv.buffer_cache_limit_bytes)
    common = PlanRequest(
        schemes=(scheme,),
        weights=packaged.manifest.recipe.weights,  # what `auto` chose
        # The largest chunk the app prefills: the bundle's prefill step, or a whole soak step when that is
        # smaller (each step feeds at most step_tokens new tokens).
        prefill_step=min(kv.prefill_step_size, options.step_tokens),
        buffer_cache_bytes=held_cache,
        # The virtual iPhone runs the app's MLX on this host's CPU, whose attention materializes the prefill
        # scores; a real phone's plan is the default (Metal).
        backend="cpu",
    )
    # The limit: the plan's own peak footprint at `room_tokens` (capped there, so the plan stops at it).
    sizing = plan_memory(
        spec, profile, common.model_copy(update={"margin": 0.0, "max_context_cap": options.room_tokens})
    )
    limit = sizing.budget_at_max_context[scheme].total_bytes
    # The planner on the phone the soak runs on: the same profile with the small limit.
    given = SourcedInt(value=limit, basis="reported", source="kvrig demo: the virtual iPhone's limit")
    small = profile.model_copy(update={"app_memory_limit": AppMemoryLimit(default_bytes=given)})
    exact = plan_memory(spec, small, common.model_copy(update={"margin": 0.0, "limit": "default"}))
    margined = plan_memory(spec, small, common.model_copy(update={"margin": DEFAULT_MARGIN, "limit": "default"}))
    predicted = Prediction(
        max_context=exact.max_context[scheme],
        limit_bytes=limit,
        footprint_at_max_context_bytes=exact.budget_at_max_context[scheme].total_bytes,
    )
    _say(
        on_event,
        f"plan: limit {limit / 2**20:.1f} MiB on a virtual {profile.marketing_name}: "
        f"max context {predicted.max_context} ({margined.max_context[scheme]} with the {DEFAULT_MARGIN:.0%} margin)",
    )

    _say(on_event, "rendering the app and building the .ipa for the virtual iPhone ...")
    project = render_app(bundle, out / "app", AppOptions(name=APP_NAME, bundle_id=APP_ID), replace=True).project
    ipa = build_virtual_ipa(project, out, APP_RUNTIMES[runtime.runtime])
    _say(on_event, f"the virtual iPhone runs {runtime.why}")

    soak_result = _soak_on_virtual_iphone(options, bundle, ipa, limit, predicted, scheme, on_event)
    return DemoResult(
        bundle=bundle,
        project=project,
        ipa=ipa,
        device=profile.marketing_name,
        limit_bytes=limit,
        predicted_max_context=exact.max_context[scheme],
        predicted_max_context_with_margin=margined.max_context[scheme],
        margin=DEFAULT_MARGIN,
        predicted_footprint_bytes=exact.budget_at_max_context[scheme].total_bytes,
        soak=soak_result,
        soak_dir=out / "soak",
        kv=packaged.manifest.recipe.kv,
        prefill_step=kv.prefill_step_size,
        step_tokens=options.step_tokens,
        ios=options.ios,
        app_runtime=runtime.runtime,
        app_runtime_why=runtime.why,
        buffer_cache_bytes=held_cache,
        buffer_cache_limit_bytes=kv.buffer_cache_limit_bytes,
    )


def _soak_on_virtual_iphone(
    options: DemoOptions,
    bundle: Path,
    ipa: Path,
    limit: int,
    predicted: Prediction,
    scheme: str,
    on_event: Event | None,
) -> SoakResult:
    # A unix socket path must stay short; the state folder lives in the output folder.
    address = f"/tmp/kvrig-demo-{os.getpid()}.sock"
    state = options.out / "virtual-iphone"
    phone = f"{options.device}, iOS {options.ios}, app limit {limit / 2**20:.1f} MiB"
    _say(on_event, f"starting a virtual iPhone ({phone}) on {address}")
    with EmulatorHost(address) as host:
        # By default an iOS 18 phone: developer services go through the CoreDeviceProxy tunnel, as on most phones.
        device = host.add_device(state, profile=options.device, limit_bytes=limit, ios=options.ios)
        udid = device.identity.udid

        _say(on_event, "deploying the app and the bundle ...")
        asyncio.run(deploy(bundle, ipa=ipa, udid=udid, usbmux_address=address))

        plan = make_plan(
            max_tokens=options.max_tokens,
            step_tokens=options.step_tokens,
            decode_tokens=options.decode_tokens,
            scheme=scheme,
            max_seconds=options.max_seconds,
        ).model_copy(update={"on_critical": "continue"})  # keep growing into the kernel's limit
        soak_options = SoakOptions(
            poll_interval_s=0.5, bundle=bundle.name, predicted=predicted, on_event=on_event, report_wait_s=10
        )
        _say(on_event, f"soaking: {options.step_tokens} tokens per step until jetsam ...")
        try:
            return asyncio.run(
                soak(APP_ID, plan, options.out / "soak", udid=udid, options=soak_options, usbmux_address=address)
            )
        finally:
            _say(on_event, "stopping the virtual iPhone")
            host.run(device.apps.kill_all())
