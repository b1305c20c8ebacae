"""Launched apps: DTX process control (launch, pid lookup, kill), footprint accounting and the jetsam kill,
the JetsamEvent report (parsed by pycrashreport), crash-report services, syslog, and iOS 17.4 refusal."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import yaml
from pycrashreport.crash_report import BugType, get_crash_report_from_buf
from pydantic import TypeAdapter
from pymobiledevice3.dtx import DTXNsError
from pymobiledevice3.exceptions import InvalidServiceError
from pymobiledevice3.lockdown import create_using_usbmux
from pymobiledevice3.services.crash_reports import CrashReportsManager
from pymobiledevice3.services.dvt.instruments.dvt_provider import DvtProvider
from pymobiledevice3.services.dvt.instruments.process_control import ProcessControl
from pymobiledevice3.services.os_trace import OsTraceService
from pymobiledevice3.services.syslog import SyslogService

from kvrig.compat.crash_report import report_body
from kvrig.schemas.telemetry import TELEMETRY_FILE, TelemetryEvent
from kvrig.virtual.footprint import Measurement, footprint_bytes
from tests.virtual.conftest import BUNDLE_ID, LIMIT_BYTES, TESTAPP_ARGS, Emulator, install

PAGE = 16384


@pytest.fixture(scope="module")
def installed(emulator: Emulator, ipa: Path) -> Emulator:
    install(emulator.udid, ipa)
    return emulator


def test_footprint_formula_counts_mlx_arrays_once() -> None:
    # weights and KV inside MLX's active memory are not counted twice; cache and baseline are added
    m = Measurement(mlx_active_bytes=300, mlx_cache_bytes=20, kv_bytes=100, weight_bytes=150)
    assert footprint_bytes(m, baseline_bytes=1000) == 1000 + 300 + 20
    # weights mapped outside the allocator still count
    assert footprint_bytes(Measurement(mlx_active_bytes=50, kv_bytes=100, weight_bytes=400), 0) == 500


def test_dvt_launch_pid_lookup_and_kill(installed: Emulator) -> None:
    async def main() -> tuple[int, int, dict]:
        lockdown = await create_using_usbmux(serial=installed.udid)
        async with DvtProvider(lockdown) as dvt, ProcessControl(dvt) as control:
            pid = await control.launch(BUNDLE_ID, arguments=[*TESTAPP_ARGS, "--max-tokens", "256"])
            looked_up = await control.process_identifier_for_bundle_identifier(BUNDLE_ID)
            await control.kill(pid)
            with pytest.raises(DTXNsError, match="not installed"):
                await control.launch("com.example.not.installed")
        await lockdown.close()
        process = await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(installed.device.apps.wait(pid, 20), installed.host.loop)
        )
        return pid, looked_up, {"outcome": process.outcome}

    pid, looked_up, result = asyncio.run(main())
    assert pid > 0 and looked_up == pid
    assert result["outcome"] == "killed"
    assert installed.device.apps.pid_for_bundle(BUNDLE_ID) == 0


def test_jetsam_kill_at_the_limit_writes_a_real_report(installed: Emulator) -> None:
    device = installed.device
    telemetry = device.state.container(BUNDLE_ID) / "Documents" / TELEMETRY_FILE
    telemetry.unlink(missing_ok=True)
    before = set(device.state.crash.glob("JetsamEvent-*.ips"))
    pid = installed.host.run(device.apps.launch(BUNDLE_ID, arguments=TESTAPP_ARGS))
    process = installed.host.run(device.apps.wait(pid, 90), timeout=100)
    assert process.outcome == "jetsam"

    # telemetry: valid events, KV bytes equal to the cache shapes the app was given (8 layers x K,V x
    # 8 heads x 128 dims x fp16 per token), footprint below the limit while the app lived
    adapter = TypeAdapter(TelemetryEvent)
    events = [adapter.validate_python(json.loads(line)) for line in telemetry.read_text().splitlines() if line]
    steps = [e for e in events if e.event == "step"]
    assert events[0].event == "start" and steps
    for step in steps:
        assert step.kv_bytes == step.context_tokens * 8 * 2 * 8 * 128 * 2
        assert step.context_tokens % 256 == 0
        assert step.phys_footprint_bytes < LIMIT_BYTES
    assert any(e.event == "memory_pressure" and e.level == "warning" for e in events)

    (report_path,) = set(device.state.crash.glob("JetsamEvent-*.ips")) - before
    report = get_crash_report_from_buf(report_path.read_text(), filename=report_path.name)
    assert report.bug_type == BugType.Jetsam_298
    body = report_body(report)
    assert body["product"] == "iPhone16,1"
    assert body["build"] == "iPhone OS 16.7 (20H19)"
    assert body["memoryStatus"]["pageSize"] == PAGE
    (victim,) = [p for p in body["processes"] if p.get("reason")]
    assert victim["reason"] == "per-process-limit"
    assert victim["pid"] == pid and victim["name"] == "KVSoak"
    # killed at the limit: at or past it, by less than one more 256-token step (8 MiB of KV)
    killed_at = victim["rpages"] * PAGE
    assert LIMIT_BYTES <= killed_at < LIMIT_BYTES + 8 * 1024 * 1024 + 21 * 1024 * 1024
    assert killed_at > steps[-1].phys_footprint_bytes
    assert victim["lifetimeMax"] >= victim["rpages"]
    assert victim["rpages"] == math.ceil(process.account.current_bytes / PAGE)
    # the baseline is the device profile's, the same one the planner uses (read from the YAML itself)
    profile_yaml = yaml.safe_load((Path(__file__).parents[2] / "device_profiles" / "iphone-15-pro.yaml").read_text())
    assert process.account.baseline_bytes == profile_yaml["app_baseline_bytes"]["value"]
    # the kernel said so in the log
    assert any(
        "killing_specific_process" in line.message and str(pid) in line.message for line in device.syslog.history
    )


def test_crash_report_services_list_pull_and_flush(installed: Emulator, tmp_path: Path) -> None:
    device = installed.device
    (device.state.crash_pending / "Pending-2026-01-01-000000.ips").write_text('{"bug_type":"298"}\n{}\n')

    async def main() -> list[str]:
        lockdown = await create_using_usbmux(serial=installed.udid)
        async with CrashReportsManager(lockdown) as crashes:
            await crashes.flush()
            listing = await crashes.ls("/")
            await crashes.pull(str(tmp_path / "pulled"), progress_bar=False)
        await lockdown.close()
        return listing

    listing = asyncio.run(main())
    assert "/Pending-2026-01-01-000000.ips" in listing
    assert (tmp_path / "pulled" / "Pending-2026-01-01-000000.ips").exists()
    assert not any(device.state.crash_pending.iterdir())


def test_syslog_relay_and_os_trace_stream_device_log(installed: Emulator) -> None:
    async def main() -> tuple[list[str], list]:
        lockdown = await create_using_usbmux(serial=installed.udid)
        text: list[str] = []
        emit = installed.device.syslog.emit
        # Each line read (the device's idle heartbeat comes every second) triggers the line we look for,
        # so it is emitted only once the stream is surely subscribed.
        async with SyslogService(lockdown) as relay:
            async for line in relay.watch():
                text.append(line)
                if "hello relay" in line:
                    break
                installed.host.loop.call_soon_threadsafe(emit, "lockdownd", "hello relay")
        entries = []
        service = OsTraceService(lockdown)
        async for entry in service.syslog():
            entries.append(entry)
            if entry.message == "hello trace":
                break
            installed.host.loop.call_soon_threadsafe(emit, "lockdownd", "hello trace")
        await service.close()
        await lockdown.close()
        return text, entries

    text, entries = asyncio.run(asyncio.wait_for(main(), 30))
    assert "lockdownd[61] <Notice>: hello relay" in text[-1]
    assert entries[-1].pid == 61 and entries[-1].filename.endswith("lockdownd")


def test_ios17_refuses_developer_services_without_tunnel(emulator: Emulator) -> None:
    async def main() -> None:
        lockdown = await create_using_usbmux(serial=emulator.ios17.identity.udid)
        try:
            assert lockdown.product_version == "17.4"
            async with DvtProvider(lockdown):
                pass
        finally:
            await lockdown.close()

    with pytest.raises(InvalidServiceError):
        asyncio.run(main())


def test_relative_state_folder_gives_absolute_container_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Apps run with their container as working directory, so a relative state folder (`kvrig demo -o build/x`)
    must not leak relative paths into the app's environment (it did: the app could not find its container)."""
    from kvrig.virtual.device import VirtualDevice

    monkeypatch.chdir(tmp_path)
    device = VirtualDevice("relative-state")
    assert device.state.container("dev.kvrig.x").is_absolute()
    assert device.state.root == tmp_path / "relative-state"
