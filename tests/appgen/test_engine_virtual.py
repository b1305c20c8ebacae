"""The virtual iPhone runs the compiled Swift engine as the launched app: an .ipa built with
`--app-runtime swift`, deployed with a real SmolLM2 bundle through pymobiledevice3, soaked by kvrig's driver
until the virtual kernel kills it.

Default: `test_swift_engine_soaks_into_jetsam` (about 60 s here with the debug engine, plus packaging the bundle
the Python soak tests share): small unaligned steps into a limit sized by the planner, kv_bytes against
`kvrig.planner.kv_bytes` at every step. The longer matrix (four schemes, aligned and unaligned steps, chat
turns, greedy tokens) is test_engine_linux.py, marked slow.
Expected numbers come from elsewhere: the planner's KV bytes for the same updates, the limit the virtual
iPhone was given, and its JetsamEvent report."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvrig.appgen.render import AppOptions, render_app
from kvrig.appgen.virtual_ipa import build_virtual_ipa
from kvrig.bundle.options import DEFAULT_BUFFER_CACHE_LIMIT as CACHE_CAP  # the bundle's buffer_cache_limit_bytes
from kvrig.device.deploy import deploy
from kvrig.models import load_model_spec
from kvrig.planner import PlanRequest, kv_bytes, plan_memory
from kvrig.profiles import load_profile
from kvrig.recipes import parse_kv
from kvrig.soaking.driver import SoakOptions, run_soak
from kvrig.soaking.plan import make_plan
from kvrig.virtual.device import VirtualDevice
from kvrig.virtual.swiftapp import buffer_cache_held
from tests.appgen.swift_engine import engine_binary, read_events  # noqa: F401
from tests.bundle_fixtures import smollm2_q4_k8v4
from tests.device.conftest import on_device, run
from tests.virtual.conftest import emulator_host

APP_ID = "dev.kvrig.swiftsoak"
PROFILE = "iPhone16,1"
SCHEME = "k8v4"
STEP = 64  # soak steps of 64 tokens (+1 decoded each): every cache update after the first is unaligned
ROOM = 128  # the limit: the plan's peak footprint at this context ...
TRANSIENT_ROOM = 8 * 1024 * 1024  # ... and about this much more for what the debug engine's step holds a moment
OPTIONS = SoakOptions(poll_interval_s=0.2, hang_after_s=300, report_wait_s=10, battery_interval_s=None)


@dataclass
class Phone:
    device: VirtualDevice
    limit: int
    bundle: Path


@pytest.fixture(scope="module")
def phone(engine_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phone]:  # noqa: F811
    # The same bundle (name and options) the Python runtime's soak tests package: made once per session.
    bundle = smollm2_q4_k8v4(tmp_path_factory)
    sizing = plan_memory(
        load_model_spec(bundle),
        load_profile(PROFILE),
        PlanRequest(
            schemes=(SCHEME,),
            weights="q4",
            prefill_step=STEP,  # the largest chunk this soak feeds (the bundle's prefill step is larger)
            # What the engine's MLX keeps in its buffer cache on this host, measured (MLX Swift's CPU allocator
            # keeps none): counting the bundle's cap would leave room for a thousand more tokens.
            buffer_cache_bytes=buffer_cache_held("swift", CACHE_CAP),
            margin=0.0,
            max_context_cap=ROOM,
        ),
    )
    limit = sizing.budget_at_max_context[SCHEME].total_bytes + TRANSIENT_ROOM
    root = tmp_path_factory.mktemp("swiftsoak")
    project = render_app(bundle, root / "project", AppOptions(name="Swift Soak", bundle_id=APP_ID)).project
    ipa = build_virtual_ipa(project, root, "swift")
    with emulator_host(root, "swift") as host:
        device = host.add_device(root / "phone", profile=PROFILE, limit_bytes=limit)
        run(deploy(bundle, ipa=ipa, udid=device.identity.udid))
        yield Phone(device, limit, bundle)
        host.run(device.apps.kill_all())


def test_swift_engine_soaks_into_jetsam(phone: Phone, tmp_path: Path) -> None:
    plan = make_plan(max_tokens=4096, step_tokens=STEP, decode_tokens=1, scheme=SCHEME)
    plan = plan.model_copy(update={"on_critical": "continue"})  # run into the kernel, as a soak should
    try:
        result = run(on_device(phone.device.identity.udid, lambda d: run_soak(d, APP_ID, plan, tmp_path, OPTIONS)))
    except BaseException:
        for line in list(phone.device.syslog.history)[-40:]:  # what the app and the kernel said
            print(f"{line.t:.1f} {line.process}[{line.pid}] {line.message[:300]}")
        raise

    # The Swift engine ran (it says so on the device log), and the kernel killed it at the limit.
    assert any("the app's Swift engine" in line.message for line in phone.device.syslog.history)
    assert result.outcome == "jetsam", result.outcome_detail
    assert result.footprint_at_kill_bytes is not None and result.footprint_at_kill_bytes >= phone.limit
    events = read_events(tmp_path / "telemetry.jsonl")
    start = events[0]
    assert start["event"] == "start" and start["product_type"] == PROFILE and start["limit_bytes"] == phone.limit
    assert not any(e["event"] == "end" for e in events)
    steps = [e for e in events if e["event"] == "step"]
    assert steps, "killed before its first step"

    # KV bytes at every step against the planner's for the same updates: each step prefills up to its target
    # (all but its last token in one chunk, the bundle's prefill step being larger, then the last one alone,
    # as mlx-lm does) and decodes one token.
    spec, scheme = load_model_spec(phone.bundle), parse_kv(SCHEME)
    updates: list[int] = []
    context = 0
    for target, step in zip(range(STEP, 4096, STEP), steps, strict=False):
        updates += [target - context - 1, 1, 1]
        context = target + 1
        assert step["context_tokens"] == context
        assert step["kv_bytes"] == kv_bytes(spec, scheme, updates), (context, updates)
    # Each step record carries the step's MLX peak (the kernel was told it pass by pass), never less than active.
    assert all(s["mlx_peak_bytes"] >= s["mlx_active_bytes"] > 0 for s in steps), steps
    # The buffer cache the engine reports at every step is what its MLX keeps (the plan above counted that).
    assert {s["mlx_cache_bytes"] for s in steps} == {buffer_cache_held("swift", CACHE_CAP)}, steps
    # The kernel's numbers reach the app, as the phone's own queries would return them.
    assert all(s["phys_footprint_bytes"] + s["available_bytes"] == phone.limit for s in steps)
    # The kill came in the step growing past the last context that survived.
    assert result.max_safe_context == steps[-1]["context_tokens"]
