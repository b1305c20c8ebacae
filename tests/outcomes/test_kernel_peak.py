"""The virtual kernel charges the peak within each step, as iOS charges every page when it is touched.

Unit checks of the accounting, then the test app on the virtual iPhone: a transient freed before the app
measures still kills it, and the JetsamEvent report (read raw, not through kvrig) shows the footprint at the
page that crossed the limit the virtual iPhone was given.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvrig.schemas.telemetry import TELEMETRY_FILE
from kvrig.virtual.footprint import FootprintAccount, Measurement, footprint_bytes, peak_footprint_bytes
from tests.device.conftest import BUNDLE_ID, Emulator, emulator, installed, ipa
from tests.virtual.conftest import LIMIT_BYTES, TESTAPP_ARGS

__all__ = ["emulator", "installed", "ipa"]
PAGE = 16384
MIB = 1024 * 1024


def test_a_transient_inside_the_step_crosses_the_limit() -> None:
    account = FootprintAccount(limit_bytes=100 * MIB, page_size=PAGE, baseline_bytes=10 * MIB)
    calm = Measurement(mlx_active_bytes=50 * MIB, mlx_peak_bytes=60 * MIB, weight_bytes=30 * MIB, kv_bytes=20 * MIB)
    assert account.update(calm) == 60 * MIB and not account.over_limit
    assert account.peak_bytes == 70 * MIB and account.lifetime_max_bytes == 70 * MIB
    # After the step the app is back at 60 MiB, but a 45 MiB transient inside it reached 105 MiB.
    spike = Measurement(mlx_active_bytes=50 * MIB, mlx_peak_bytes=95 * MIB, weight_bytes=30 * MIB, kv_bytes=20 * MIB)
    assert footprint_bytes(spike, 10 * MIB) == 60 * MIB
    assert peak_footprint_bytes(spike, 10 * MIB) == 105 * MIB
    footprint = account.update(spike)
    assert account.over_limit
    # Killed at the page that crossed the limit, not at the peak the allocation would have reached.
    assert 100 * MIB < footprint <= 100 * MIB + PAGE and footprint % PAGE == 0
    assert account.rpages == account.lifetime_max_pages == footprint // PAGE


def test_the_peak_is_counted_in_the_phones_format() -> None:
    # A host computing in float32: 40 MiB of float32 activations are 20 MiB on the phone.
    m = Measurement(
        mlx_active_bytes=50 * MIB,
        mlx_peak_bytes=90 * MIB,
        phone_format_peak_delta_bytes=-20 * MIB,
        weight_bytes=30 * MIB,
        kv_bytes=20 * MIB,
        mlx_cache_bytes=5 * MIB,
    )
    assert peak_footprint_bytes(m, 0) == 90 * MIB - 20 * MIB + 5 * MIB
    # An app that does not report a peak (an older one) is charged at its measurement, as before.
    assert peak_footprint_bytes(Measurement(mlx_active_bytes=50 * MIB), 0) == 50 * MIB
    assert Measurement.from_json({"mlx_peak_bytes": 7, "unknown_field": 1}).mlx_peak_bytes == 7


def _raw_victim(path: Path) -> tuple[dict, int]:
    header, body = path.read_text().split("\n", 1)
    assert json.loads(header)["bug_type"] == "298"
    data = json.loads(body)
    (victim,) = [p for p in data["processes"] if p.get("reason")]
    return victim, data["memoryStatus"]["pageSize"]


def test_a_freed_transient_kills_the_app_at_the_limit(installed: Emulator) -> None:
    device = installed.device
    telemetry = device.state.container(BUNDLE_ID) / "Documents" / TELEMETRY_FILE
    one_step = [*TESTAPP_ARGS, "--max-tokens", "256", "--exit-when-done"]

    # Without the transient, one step fits easily: the app ends on its own.
    telemetry.unlink(missing_ok=True)
    pid = installed.host.run(device.apps.launch(BUNDLE_ID, arguments=one_step))
    process = installed.host.run(device.apps.wait(pid, 90), timeout=100)
    assert process.outcome == "exited 0"
    step = next(json.loads(line) for line in telemetry.read_text().splitlines() if '"step"' in line)
    assert step["phys_footprint_bytes"] < LIMIT_BYTES

    # The same step with a transient as large as the limit, freed before the app measures: jetsam.
    telemetry.unlink(missing_ok=True)
    before = set(device.state.crash.glob("JetsamEvent-*.ips"))
    transient_mb = str(LIMIT_BYTES // MIB)
    pid = installed.host.run(device.apps.launch(BUNDLE_ID, arguments=[*one_step, "--transient-mb", transient_mb]))
    process = installed.host.run(device.apps.wait(pid, 90), timeout=100)
    assert process.outcome == "jetsam"
    assert not any('"step"' in line for line in telemetry.read_text().splitlines())  # it never saw a reply
    (report,) = set(device.state.crash.glob("JetsamEvent-*.ips")) - before
    victim, page = _raw_victim(report)
    assert victim["pid"] == pid and victim["reason"] == "per-process-limit"
    assert LIMIT_BYTES < victim["rpages"] * page <= LIMIT_BYTES + page


def test_mapped_weights_are_not_charged() -> None:
    """What iOS leaves out: the weights an app maps from its file are in MLX's numbers, not in the footprint."""
    base = {"mlx_active_bytes": 70 * MIB, "mlx_peak_bytes": 95 * MIB, "weight_bytes": 30 * MIB, "kv_bytes": 20 * MIB}
    loaded, mapped = Measurement(**base), Measurement(**base, mapped_weight_bytes=30 * MIB)
    assert footprint_bytes(loaded, 10 * MIB) - footprint_bytes(mapped, 10 * MIB) == 30 * MIB
    assert peak_footprint_bytes(loaded, 10 * MIB) - peak_footprint_bytes(mapped, 10 * MIB) == 30 * MIB
    # The same step kills the loaded app and leaves the mapped one 5 MiB under a 100 MiB limit.
    killed, kept = (FootprintAccount(limit_bytes=100 * MIB, page_size=PAGE, baseline_bytes=10 * MIB) for _ in "ab")
    killed.update(loaded)
    kept.update(mapped)
    assert killed.over_limit and not kept.over_limit and kept.peak_bytes == 75 * MIB
    # An app cannot claim more file-backed bytes than the weights it reports (the rest is still charged).
    greedy = Measurement(**base, mapped_weight_bytes=500 * MIB)
    assert footprint_bytes(greedy, 10 * MIB) == footprint_bytes(mapped, 10 * MIB)
    assert Measurement.from_json({"mapped_weight_bytes": 9}).mapped_weight_bytes == 9
