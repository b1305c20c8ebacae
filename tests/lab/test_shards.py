"""A lab larger than one host: two virtual hosts (two emulator processes, each serving two virtual iPhones on a
unix socket and on a loopback TCP port), reached by one controller through `--usbmuxd NAME=HOST:PORT`.

Shards 1/2 and 2/2 run in parallel and merged give the same runs, outcomes and gates as one unsharded run; the
merged junit.xml passes a JUnit schema check; a phone that goes away on one host fails only that host's runs,
and the merge names the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xmlschema
import yaml

from kvrig.lab.targets import shard_of
from kvrig.profiles import load_profile
from kvrig.schemas import load_model_file
from kvrig.schemas.results import ResultsFile, SoakResult
from kvrig.virtual.state import DeviceState
from tests.lab.conftest import BUNDLE_ID, FAST, ROOT, short_entry
from tests.virtual.conftest import make_ipa

JUNIT_XSD = ROOT / "tests" / "data" / "junit.xsd"
PHONES = (("iPhone16,1", 160), ("iPhone14,2", 128))  # (profile, limit MiB) on each host


def kvrig(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "USBMUXD_SOCKET_ADDRESS"}  # only what --usbmuxd says
    return subprocess.run(
        [sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )


def kvrig_popen(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "USBMUXD_SOCKET_ADDRESS"}
    return subprocess.Popen(
        [sys.executable, "-m", "kvrig", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )


def state_with_shard(root: Path, profile: str, limit_mb: int, shard: int) -> tuple[Path, str]:
    """A virtual phone's state folder whose (random) UDID falls in `shard` of 2, so both shards span both
    hosts; the emulator keeps the UDID of an existing folder."""
    spec = load_profile(profile)
    for attempt in range(64):
        folder = root / f"try-{attempt}"
        _, identity = DeviceState.open(
            folder,
            product_type=profile,
            marketing_name=spec.marketing_name,
            ios="16.7",
            limit_bytes=limit_mb * 1024 * 1024,
            page_size=spec.page_size,
        )
        if shard_of(identity.udid, 2) == shard:
            return folder, identity.udid
    raise AssertionError("no UDID in the wanted shard after 64 tries")


@dataclass
class Host:
    name: str
    socket: str
    tcp: str  # 127.0.0.1:<port the emulator bound>
    udids: list[str]
    states: list[Path]

    @property
    def usbmuxd(self) -> str:
        return f"{self.name}={self.tcp}"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Host]]:
    root = tmp_path_factory.mktemp("hosts")
    started: list[Host] = []
    try:
        for name in ("mini-a", "mini-b"):
            sock = f"/tmp/kvrig-{name}-{os.getpid()}.sock"
            host = Host(name, sock, "", [], [])
            for shard, (profile, limit) in enumerate(PHONES, start=1):
                state, udid = state_with_shard(root / name / profile, profile, limit, shard)
                args = ["--socket", sock, "--state", str(state), "--profile", profile, "--limit-mb", str(limit)]
                proc = kvrig("virtual", "start", "--detach", "--tcp", "127.0.0.1:0", "--baseline-mb", "48", *args)
                assert proc.returncode == 0, proc.stderr
                host.udids.append(udid)
                host.states.append(state)
                if not started or started[-1] is not host:
                    started.append(host)
            status = json.loads(kvrig("virtual", "status", "--socket", sock, "--json").stdout)
            host.tcp = status["TcpAddress"]
            assert host.tcp.startswith("127.0.0.1:") and not host.tcp.endswith(":0")
        yield started
    finally:
        for host in started:
            kvrig("virtual", "stop", "--socket", host.socket)


def write_lab(path: Path, ipa: Path, **extra: Any) -> Path:
    lab = {
        "schema": 1,
        "name": "two-hosts",
        "devices": [{"udid": "any"}],
        "matrix": [
            {
                "name": "grow",
                "app_id": BUNDLE_ID,
                "ipa": str(ipa),
                "schemes": ["fp16"],
                "soak": {"step_tokens": 512, "max_tokens": 1_000_000, "decode_tokens": 1},
                # the 160 MiB phones hold this, the 128 MiB ones less (the virtual kernel charges each step's
                # peak, so 160 MiB is killed in the step to 2048): a gate that splits the lab
                "gates": {"min_max_safe_context": 1536},
            },
            short_entry(),
        ],
        "gates": {"min_max_safe_context": 512},
        "threshold": {"confirm_runs": 0},
        "timeouts": FAST,
        **extra,
    }
    path.write_text(yaml.safe_dump(lab, sort_keys=False))
    return path


def digest(runs: list[SoakResult]) -> dict[tuple[str, str, str], tuple[Any, ...]]:
    """What must not depend on sharding: per phone × entry × scheme, the host, outcome, contexts and gates."""
    return {
        (r.device.udid, r.entry or "", r.scheme): (
            r.device.host,
            r.outcome,
            r.max_context_reached,
            r.max_safe_context,
            tuple((g.gate, g.status, g.measured) for g in r.gates),
        )
        for r in runs
    }


@pytest.fixture(scope="module")
def sharded(hosts: list[Host], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sharded")
    lab = write_lab(root / "lab.yaml", make_ipa(root / "KVSoak.ipa"))
    usbmuxd = [arg for h in hosts for arg in ("--usbmuxd", h.usbmuxd)]
    # the two shards at once, as two CI jobs would run them
    shards = [
        kvrig_popen("lab", "run", str(lab), "--shard", f"{k}/2", *usbmuxd, "-o", str(root / f"s{k}")) for k in (1, 2)
    ]
    codes = []
    for proc in shards:
        _, err = proc.communicate(timeout=600)
        codes.append((proc.returncode, err))
    whole = kvrig("lab", "run", str(lab), *usbmuxd, "-o", str(root / "whole"), timeout=600)
    merged = kvrig("lab", "merge", str(root / "s1"), str(root / "s2"), "-o", str(root / "merged"))
    return {"root": root, "lab": lab, "shards": codes, "whole": whole, "merged": merged, "usbmuxd": usbmuxd}


def test_devices_lists_every_phone_with_its_host(hosts: list[Host]) -> None:
    proc = kvrig("devices", "--json", *[arg for h in hosts for arg in ("--usbmuxd", h.usbmuxd)])
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    found = {d["udid"]: d["host"] for d in shown}
    assert found == {udid: h.name for h in hosts for udid in h.udids}
    # the preflight beside the host: these virtual phones run iOS 16.7, which serves process control over
    # lockdown (no tunnel) and has Developer Mode, on by default
    for d in shown:
        assert d["tunnel"]["kind"] == "lockdown" and d["developer_mode"] is True and d["ready"] is True, d


def test_each_shard_drives_its_own_phones_on_both_hosts(sharded: dict[str, Any], hosts: list[Host]) -> None:
    root = sharded["root"]
    for k, (code, err) in enumerate(sharded["shards"], start=1):
        # shard 1 holds the 160 MiB phones (every gate passes), shard 2 the 128 MiB ones (the `grow` gate fails)
        assert code == (0 if k == 1 else 17), err
        results = load_model_file(ResultsFile, root / f"s{k}" / "results.json")
        assert results.lab is not None and results.lab.shard == f"{k}/2"
        # state_with_shard put phone k of each host in shard k
        assert {(r.device.host, r.device.udid) for r in results.runs} == {(h.name, h.udids[k - 1]) for h in hosts}


def test_merged_shards_equal_one_unsharded_run(sharded: dict[str, Any], hosts: list[Host]) -> None:
    root, whole, merged = sharded["root"], sharded["whole"], sharded["merged"]
    assert whole.returncode == 17, whole.stderr
    assert merged.returncode == 17, merged.stderr  # gates evaluated again on the merged set: the same verdict
    one = load_model_file(ResultsFile, root / "whole" / "results.json").runs
    both = load_model_file(ResultsFile, root / "merged" / "results.json").runs
    assert len(both) == len(one) == 8  # 4 phones x 2 entries
    assert digest(both) == digest(one)
    outcomes = {(r.device.udid, r.entry): r.outcome for r in both}
    assert {o for (_, e), o in outcomes.items() if e == "grow"} == {"jetsam"}
    assert {o for (_, e), o in outcomes.items() if e == "short"} == {"completed"}
    failed_gates = {(r.device.udid, g.gate) for r in both for g in r.gates if g.status == "failed"}
    assert failed_gates == {(h.udids[1], "min_max_safe_context") for h in hosts}  # the two 128 MiB phones
    # every file a merged run names is in the merged folder
    for r in both:
        assert r.files.telemetry and (root / "merged" / r.files.telemetry).is_file()
        for report in r.files.jetsam_reports:
            assert (root / "merged" / report).is_file()
    assert "failed on host mini-a" in merged.stderr and "failed on host mini-b" in merged.stderr


def test_merged_junit_passes_the_schema_with_one_case_per_run(sharded: dict[str, Any]) -> None:
    schema = xmlschema.XMLSchema(str(JUNIT_XSD))
    path = sharded["root"] / "merged" / "junit.xml"
    schema.validate(str(path))
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    runs = load_model_file(ResultsFile, sharded["root"] / "merged" / "results.json").runs
    assert len(cases) == len(runs) == int(root.get("tests", "0"))
    names = [c.get("name") for c in cases]
    assert len(set(names)) == len(names)
    for case in cases:
        props = {p.get("name"): p.get("value") for p in case.findall("properties/property")}
        assert props["host"] in case.get("name") and props["udid"] in case.get("name")
    assert root.get("failures") == "2"
    # the schema check can fail: a case without its name is rejected
    broken = ET.parse(path)
    del next(broken.getroot().iter("testcase")).attrib["name"]
    assert not schema.is_valid(broken)


def test_merge_reports_duplicates_and_missing_shards(sharded: dict[str, Any], tmp_path: Path) -> None:
    root = sharded["root"]
    twice = kvrig("lab", "merge", str(root / "s1"), str(root / "s1"), "-o", str(tmp_path / "twice"), "--json")
    assert twice.returncode == 44, twice.stderr  # shard 2/2 is missing
    problems = json.loads(twice.stdout)["problems"]
    assert any(p.startswith("duplicate:") for p in problems)
    assert "missing shard: 2/2" in problems
    assert len(load_model_file(ResultsFile, tmp_path / "twice" / "results.json").runs) == 4  # kept once

    conflict = kvrig("lab", "merge", str(root / "whole"), str(root / "s1"), "-o", str(tmp_path / "conflict"))
    assert conflict.returncode == 43, conflict.stderr  # the same phones ran twice, with different runs
    assert "conflict" in conflict.stderr

    not_a_lab = kvrig("lab", "merge", str(tmp_path), "-o", str(tmp_path / "x"))
    assert not_a_lab.returncode == 42 and "no results.json" in not_a_lab.stderr

    # the merge never writes into a folder it merges (its shard record would be lost) or a folder of other files
    shard_results = (root / "s1" / "results.json").read_bytes()
    into_shard = kvrig("lab", "merge", str(root / "s1"), str(root / "s2"), "-o", str(root / "s1"))
    assert into_shard.returncode == 34 and (root / "s1" / "results.json").read_bytes() == shard_results
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "junit.xml").write_text("my junit")
    into_mine = kvrig("lab", "merge", str(root / "s1"), str(root / "s2"), "-o", str(mine))
    assert into_mine.returncode == 34 and "holds other files" in into_mine.stderr
    assert [p.name for p in mine.iterdir()] == ["junit.xml"] and (mine / "junit.xml").read_text() == "my junit"


def test_a_phone_lost_on_one_host_fails_only_that_hosts_runs(
    sharded: dict[str, Any], hosts: list[Host], tmp_path: Path
) -> None:
    from kvrig.virtual import control
    from kvrig.virtual.faults import FaultPlan

    lost_host = hosts[1]
    lost = lost_host.udids[0]
    # the phone drops off its host's USB while the lab installs the app on it
    control.set_faults(lost_host.socket, lost, FaultPlan(unplug_after_afc_bytes=1024))
    try:
        lab = write_lab(tmp_path / "lab.yaml", make_ipa(tmp_path / "KVSoak.ipa"))
        spec = yaml.safe_load(lab.read_text())
        spec["matrix"] = [{**spec["matrix"][1], "ipa": spec["matrix"][0]["ipa"]}]  # only `short`
        lab.write_text(yaml.safe_dump(spec))
        shards = [
            kvrig_popen("lab", "run", str(lab), "--shard", f"{k}/2", *sharded["usbmuxd"], "-o", str(tmp_path / f"s{k}"))
            for k in (1, 2)
        ]
        for proc in shards:
            proc.communicate(timeout=600)
        merged = kvrig("lab", "merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "-o", str(tmp_path / "m"), "--json")
    finally:
        control.send_control(lost_host.socket, {"MessageType": "KvrigReplug", "UDID": lost})
    assert merged.returncode == 17, merged.stderr
    runs = load_model_file(ResultsFile, tmp_path / "m" / "results.json").runs
    assert {r.device.udid: r.outcome for r in runs if r.outcome != "completed"} == {lost: "device_lost"}
    assert {r.device.host for r in runs if r.device.udid == lost} == {lost_host.name}
    problems = json.loads(merged.stdout)["problems"]
    assert [p for p in problems if p.startswith("failed on host")] == [
        f"failed on host {lost_host.name}: {lost} short[fp16]: device_lost"
    ]


def test_a_shard_without_phones_runs_nothing_and_passes(hosts: list[Host], tmp_path: Path) -> None:
    lab = write_lab(tmp_path / "lab.yaml", make_ipa(tmp_path / "KVSoak.ipa"))
    usbmuxd = [arg for h in hosts for arg in ("--usbmuxd", h.usbmuxd)]
    # this runner holds one phone of shard 1 only: shard 2 owns nothing here
    only = ["--devices", hosts[0].udids[0]]
    proc = kvrig("lab", "run", str(lab), "--shard", "2/2", *only, *usbmuxd, "-o", str(tmp_path / "s2"))
    assert proc.returncode == 0, proc.stderr
    results = load_model_file(ResultsFile, tmp_path / "s2" / "results.json")
    assert results.runs == [] and results.lab is not None and results.lab.shard == "2/2"
    assert any("owns none of the phones" in note for note in results.lab.notes)
    # a runner whose only phone is not there cannot run: the phone is reported missing
    nobody = kvrig("lab", "run", str(lab), "--devices", "0000-GONE", *usbmuxd, "-o", str(tmp_path / "x"))
    assert nobody.returncode == 18, nobody.stderr
    (missing,) = load_model_file(ResultsFile, tmp_path / "x" / "results.json").runs[:1]
    assert missing.device.udid == "0000-GONE" and "is not attached" in (missing.error or "")
