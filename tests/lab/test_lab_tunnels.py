"""The lab on iOS 16.7 and 18.6 phones: each phone's worker process opens its own device session (preflight, then
on iOS 17+ its own userspace tunnel; pymobiledevice3 allows one per process), every run records the path it went
through, and a phone whose preflight fails (Developer Mode off) fails its own runs while the others carry on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvrig.device.loop import run_async
from kvrig.lab.schedule import run_lab
from kvrig.schemas import load_model_file
from kvrig.schemas.lab import load_lab
from kvrig.schemas.results import ResultsFile
from kvrig.virtual.faults import FaultPlan
from tests.lab.conftest import short_entry
from tests.lab.test_lab_runs import write_lab
from tests.virtual.conftest import emulator_host, make_ipa


@pytest.fixture(scope="module")
def lab_out(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("lab-tunnels")
    with emulator_host(root, "labtun") as host:  # the worker processes inherit USBMUXD_SOCKET_ADDRESS
        # A phone as most labs hold them: one before iOS 17 (process control over lockdown), one after (tunnel).
        good = [host.add_device(root / f"ios-{v}", ios=v) for v in ("16.7", "18.6")]
        off = host.add_device(root / "ios18-off", ios="18.6")
        off.faults = FaultPlan(developer_mode_off=True)
        lab_file = write_lab(
            root / "lab.yaml",
            {
                "name": "tunnels",
                "devices": [{"udid": "any"}],
                "matrix": [short_entry(make_ipa(root / "KVSoak.ipa"))],
            },
        )
        results = run_async(run_lab(load_lab(lab_file), root / "out", tunnel="auto"))
        yield {"results": results, "out": root / "out", "good": good, "off": off}


def test_each_phone_runs_through_the_path_its_ios_needs(lab_out: dict[str, Any]) -> None:
    saved = load_model_file(ResultsFile, lab_out["out"] / "results.json")
    runs = {r.device.udid: r for r in saved.runs}
    old, new = (runs[phone.identity.udid] for phone in lab_out["good"])
    for run in (old, new):
        assert run.outcome == "completed", run.error
        assert run.max_context_reached == 512
        assert run.tunnel is not None and run.tunnel.mode == "auto"
    assert old.tunnel is not None and old.tunnel.kind == "lockdown"  # iOS 16.7: no tunnel needed
    # iOS 18.6 reaches process control only through a tunnel: its own userspace one, held for its runs
    assert new.tunnel is not None and new.tunnel.kind == "userspace" and new.tunnel.opened == 1


def test_a_phone_with_developer_mode_off_fails_only_its_own_runs(lab_out: dict[str, Any]) -> None:
    saved = load_model_file(ResultsFile, lab_out["out"] / "results.json")
    (run,) = [r for r in saved.runs if r.device.udid == lab_out["off"].identity.udid]
    assert run.outcome is None and run.error is not None and "Developer Mode is off" in run.error
    assert run.device.virtual is True
    assert run.tunnel is None  # the preflight stopped it before any tunnel was opened
    assert not lab_out["results"].passed
    assert sum(r.outcome == "completed" for r in saved.runs) == 2
