"""The virtual iPhone runs the compiled Swift engine as the launched app: an .ipa built with
`--app-runtime swift`, deployed with a real SmolLM2 bundle through pymobiledevice3, soaked by kvrig's driver.

Expected numbers come from elsewhere: the planner's KV bytes, and the limit the virtual iPhone was given."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.appgen.swift_engine import engine_binary, read_events  # noqa: F401
from tests.bundle_fixtures import packaged
from tests.device.conftest import on_device, run
from toolchain.appgen.render import AppOptions, render_app
from toolchain.appgen.virtual_ipa import build_virtual_ipa
from toolchain.bundle import PackageOptions
from toolchain.device.deploy import deploy
from toolchain.plan import plan as make_memory_plan
from toolchain.soak import SoakOptions, make_plan, run_soak
from toolchain.virtual.device import VirtualDevice
from toolchain.virtual.host import EmulatorHost

# Slow here (the debug engine loads for minutes on 2 shared cores); run with -m slow.
pytestmark = pytest.mark.slow

APP_ID = "dev.kvrig.swiftsoak"
PROFILE = "iPhone16,1"
KILL_CONTEXT = 512
OPTIONS = SoakOptions(poll_interval_s=0.2, hang_after_s=300, report_wait_s=10)


@dataclass
class Phones:
    large: VirtualDevice
    small: VirtualDevice
    small_limit: int
    bundle: Path


@pytest.fixture(scope="module")
def phones(engine_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phones]:  # noqa: F811
    bundle = packaged(tmp_path_factory, "smollm2-q4-k8v4", PackageOptions(weights="q4", group_size=64, kv="k8v4"))
    root = tmp_path_factory.mktemp("swiftsoak")
    memory = make_memory_plan(bundle, PROFILE, schemes=["k8v4"], weights="q4", contexts=[KILL_CONTEXT])
    small_limit = (
        memory.runtime.baseline_bytes
        + memory.weights_bytes
        + memory.runtime.buffer_cache_bytes
        + memory.kv_bytes["k8v4"][str(KILL_CONTEXT)]
    )
    project = render_app(bundle, root / "project", AppOptions(name="Swift Soak", bundle_id=APP_ID)).project
    ipa = build_virtual_ipa(project, root / "SwiftSoak-virtual.ipa", "swift")
    address = f"/tmp/kvrig-swift-{os.getpid()}-{root.name}.sock"
    previous = os.environ.get("USBMUXD_SOCKET_ADDRESS")
    os.environ["USBMUXD_SOCKET_ADDRESS"] = address
    try:
        with EmulatorHost(address) as host:
            large = host.add_device(root / "large", profile=PROFILE)
            small = host.add_device(root / "small", profile=PROFILE, limit_bytes=small_limit)
            for device in (large, small):
                run(deploy(bundle, ipa=ipa, udid=device.identity.udid))
            yield Phones(large, small, small_limit, bundle)
    finally:
        if previous is None:
            os.environ.pop("USBMUXD_SOCKET_ADDRESS", None)
        else:
            os.environ["USBMUXD_SOCKET_ADDRESS"] = previous


def _soak(device: VirtualDevice, plan, out: Path):  # type: ignore[no-untyped-def]
    try:
        return run(on_device(device.identity.udid, lambda d: run_soak(d, APP_ID, plan, out, OPTIONS)))
    except BaseException:
        for line in list(device.syslog.history)[-40:]:  # what the app and the kernel said, for the report
            print(f"{line.t:.1f} {line.process}[{line.pid}] {line.message[:300]}")
        raise


def test_swift_engine_soaks_on_the_virtual_iphone(phones: Phones, tmp_path: Path) -> None:
    plan = make_plan(max_tokens=512, step_tokens=256, decode_tokens=2, scheme="k8v4")
    result = _soak(phones.large, plan, tmp_path)
    assert result.outcome == "completed", result.outcome_detail
    lines = [line.message for line in phones.large.syslog.history]
    assert any("the app's Swift engine" in m for m in lines), lines[-20:]
    events = read_events(tmp_path / "telemetry.jsonl")
    assert events[0]["event"] == "start" and events[0]["product_type"] == PROFILE
    assert events[-1]["event"] == "end" and events[-1]["reason"] == "completed"
    steps = [e for e in events if e["event"] == "step"]
    assert [s["context_tokens"] for s in steps] == [258, 514]
    # The kernel's numbers reach the app, as the phone's own queries would return them.
    assert all(0 < s["phys_footprint_bytes"] < s["phys_footprint_bytes"] + s["available_bytes"] for s in steps)
    memory = make_memory_plan(phones.bundle, PROFILE, schemes=["k8v4"], weights="q4", contexts=[258, 514])
    for s in steps:
        assert s["kv_bytes"] == memory.kv_bytes["k8v4"][str(s["context_tokens"])], s


def test_swift_engine_runs_into_jetsam(phones: Phones, tmp_path: Path) -> None:
    plan = make_plan(max_tokens=4096, step_tokens=256, decode_tokens=1, scheme="k8v4")
    plan = plan.model_copy(update={"on_critical": "continue"})  # run into the kernel, as a soak should
    result = _soak(phones.small, plan, tmp_path)
    assert result.outcome == "jetsam", result.outcome_detail
    assert result.footprint_at_kill_bytes is not None and result.footprint_at_kill_bytes >= phones.small_limit
    events = read_events(tmp_path / "telemetry.jsonl")
    assert not any(e["event"] == "end" for e in events)
    assert result.max_context_reached <= KILL_CONTEXT
