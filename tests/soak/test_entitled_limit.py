"""iOS's rule on the virtual iPhone: an app whose entitlements include increased-memory-limit runs under the
profile's entitled limit, others under the default one. Read through the real pymobiledevice3 client: the limit
runningboardd states (syslog_relay), the kernel's kill line and the JetsamEvent report pulled off the phone.

The phone runs a profile with small limits (a YAML file, as `--profile` takes one) so each soak ends in a few
steps; expected values come from that profile, never from the reader under test."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from examples.make_test_ipa import make_ipa
from kvrig.device import apps
from kvrig.profiles import INCREASED_MEMORY_LIMIT, AppMemoryLimit, SourcedInt, load_profile
from kvrig.soaking.driver import SoakOptions, run_soak
from kvrig.soaking.plan import make_plan
from kvrig.virtual.device import VirtualDevice
from tests.soak.conftest import BUNDLE_ID, on_device, run
from tests.virtual.conftest import emulator_host

MIB = 1024 * 1024
DEFAULT, ENTITLED = 128 * MIB, 192 * MIB
STEP_BYTES = 32 * MIB  # 1024 tokens of the test app's fp16 KV
ENTITLED_ID = "dev.kvrig.entitled"
FAST = SoakOptions(poll_interval_s=0.2, hang_after_s=30, report_wait_s=3)


def small_profile(path: Path, entitled: int | None) -> Path:
    """An iPhone 15 Pro with small limits, written as a profile file."""
    base = load_profile("iPhone16,1")

    def sourced(value: int) -> SourcedInt:
        return SourcedInt(value=value, basis="reported", source="a test's small phone")

    limit = AppMemoryLimit(default_bytes=sourced(DEFAULT), entitled_bytes=sourced(entitled) if entitled else None)
    small = base.model_copy(
        update={"name": "small-iphone", "ram_bytes": sourced(512 * MIB), "app_memory_limit": limit, "ram_variants": []}
    )
    path.write_text(yaml.safe_dump(small.model_dump(mode="json", by_alias=True)))
    return path


@pytest.fixture(scope="module")
def phone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VirtualDevice]:
    """A phone started with no limit of its own, so its profile's limits apply, with both apps installed."""
    root = tmp_path_factory.mktemp("entitled")
    # Both development-signed; one also asks for the larger limit.
    plain = make_ipa(root / "plain.ipa", entitlements={"get-task-allow": True})
    entitlements = {INCREASED_MEMORY_LIMIT: True, "get-task-allow": True}
    entitled = make_ipa(root / "entitled.ipa", ENTITLED_ID, "KVEntitled", entitlements=entitlements)
    with emulator_host(root, "ent") as host:
        device = host.add_device(root / "phone", profile=str(small_profile(root / "small.yaml", ENTITLED)))
        device.baseline_bytes = 48 * MIB
        for ipa in (plain, entitled):
            run(on_device(device.identity.udid, lambda d, ipa=ipa: apps.install(d, ipa)))
        yield device


@pytest.mark.parametrize(
    ("app", "limit"),
    [(ENTITLED_ID, ENTITLED), (BUNDLE_ID, DEFAULT)],
    ids=["entitled", "not-entitled"],
)
def test_an_app_is_killed_at_the_limit_its_entitlements_give_it(
    phone: VirtualDevice, app: str, limit: int, tmp_path: Path
) -> None:
    plan = make_plan(max_tokens=1_000_000, step_tokens=1024, decode_tokens=1, scheme="fp16")
    result = run(on_device(phone.identity.udid, lambda d: run_soak(d, app, plan, tmp_path, FAST)))

    assert result.outcome == "jetsam", result.outcome_detail
    stated = result.stated_limit  # runningboardd's line and the kernel's, as syslog_relay carried them
    assert stated is not None and stated.entitled is (app == ENTITLED_ID)  # as installation_proxy lists it
    assert stated.active_bytes == stated.inactive_bytes == stated.exceeded_bytes == limit
    mb = limit // MIB
    assert any(f"Memory Limits: active {mb} inactive {mb}" in line for line in stated.lines)
    assert f"exceeded mem limit: ActiveHard {mb} MB (fatal)" in (result.evidence[1].line or "")

    # The JetsamEvent report pulled through crash_report_copy_mobile: the victim's footprint crossed this limit,
    # within the last step, so not the other limit.
    (report,) = result.files.jetsam_reports
    body = json.loads((tmp_path / report).read_text().split("\n", 1)[1])
    (victim,) = [p for p in body["processes"] if p.get("reason") == "per-process-limit"]
    peak = victim["lifetimeMax"] * body["memoryStatus"]["pageSize"]
    assert limit < peak <= limit + STEP_BYTES


def test_a_phone_without_a_known_entitled_limit_or_given_one_limit_gives_that_to_every_app(tmp_path: Path) -> None:
    unknown = VirtualDevice(tmp_path / "unknown", profile=str(small_profile(tmp_path / "unknown.yaml", None)))
    pinned = VirtualDevice(
        tmp_path / "pinned", profile=str(small_profile(tmp_path / "knows.yaml", ENTITLED)), limit_bytes=100 * MIB
    )
    for entitlements in ({INCREASED_MEMORY_LIMIT: True}, {INCREASED_MEMORY_LIMIT: False}, None):
        assert unknown.app_limit_bytes(entitlements) == DEFAULT
        assert pinned.app_limit_bytes(entitlements) == 100 * MIB  # `--limit-mb`: every app's, as tests pin it
