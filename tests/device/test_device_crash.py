"""Crash reports: flush, list, pull; names chosen by the device never leave the output folder."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest

from kvrig.device import crash, syslog
from kvrig.device.paths import clean_component, flat_name, safe_join
from kvrig.exceptions import DeviceError
from tests.device.conftest import Emulator, on_device, run

HOSTILE_ON_DISK = [
    "..\\..\\evil-backslash.ips",  # a Windows-style climb
    "JetsamEvent-2026-01-01-000000.ips",
    "JetsamEvent-\x1b[31mred\n.ips",  # terminal escape and newline
    "....",
    "-rf .ips",
    "J" * 250 + ".ips",
]


def _tree(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


def test_flush_list_and_pull_hostile_names(emulator: Emulator, tmp_path: Path) -> None:
    store, pending = emulator.device.state.crash, emulator.device.state.crash_pending
    for i, name in enumerate(HOSTILE_ON_DISK):
        (store / name).write_text(f'{{"bug_type":"298"}}\n{{"n": {i}}}\n')
    (pending / "JetsamEvent-2026-02-02-000000.ips").write_text('{"bug_type":"298"}\n{}\n')
    work = tmp_path / "work"
    out = work / "reports"
    work.mkdir()
    (work / "keep.txt").write_text("outside the output folder")

    async def job(device):  # type: ignore[no-untyped-def]
        before = await crash.list_reports(device)
        await crash.flush(device)
        listed = await crash.list_reports(device)
        jetsam = await crash.list_jetsam_reports(device)
        pulled = (await crash.pull_reports(device, listed, out)).pulled
        return before, listed, jetsam, pulled

    before, listed, jetsam, pulled = run(on_device(emulator.udid, job))
    assert "/JetsamEvent-2026-02-02-000000.ips" not in before
    assert "/JetsamEvent-2026-02-02-000000.ips" in listed and "/JetsamEvent-2026-02-02-000000.ips" in jetsam
    assert "/" + HOSTILE_ON_DISK[0] not in jetsam
    assert len(pulled) == len(listed) and len(set(pulled)) == len(pulled)
    for path in pulled:
        assert path.parent == out  # flat, inside the folder
        assert all(ch.isprintable() for ch in path.name) and "\\" not in path.name
        assert path.name not in (".", "..") and len(path.name.encode()) <= 200
    assert _tree(work) == {"keep.txt", "reports"} | {f"reports/{p.name}" for p in pulled}
    contents = sorted(p.read_text() for p in pulled)
    for i in range(len(HOSTILE_ON_DISK)):
        assert f'{{"bug_type":"298"}}\n{{"n": {i}}}\n' in contents
    for name in [*HOSTILE_ON_DISK, "JetsamEvent-2026-02-02-000000.ips"]:
        (store / name).unlink()


def test_device_paths_that_climb_stay_inside(emulator: Emulator, tmp_path: Path) -> None:
    """A listing may name `../../x`: the phone serves what it resolves that to, we write inside `out`."""
    store = emulator.device.state.crash
    (store / "evil.ips").write_text("payload")
    out = tmp_path / "a" / "b" / "out"
    climbing = ["/../../evil.ips", "../../../evil.ips", "/./../evil.ips"]
    pulled = run(on_device(emulator.udid, lambda d: crash.pull_reports(d, climbing, out))).pulled
    assert [p.parent for p in pulled] == [out] * 3
    assert [p.read_text() for p in pulled] == ["payload"] * 3
    assert _tree(tmp_path) == {"a", "a/b", "a/b/out"} | {f"a/b/out/{p.name}" for p in pulled}
    (store / "evil.ips").unlink()


@pytest.mark.parametrize(
    ("device_path", "expected"),
    [
        ("../../etc/passwd", "etc/passwd"),
        ("/abs/path.ips", "abs/path.ips"),
        ("..\\..\\x.ips", "x.ips"),
        ("a/../../b.ips", "a/b.ips"),
        ("..", "_"),
    ],
)
def test_safe_join_never_climbs(tmp_path: Path, device_path: str, expected: str) -> None:
    assert safe_join(tmp_path, device_path) == tmp_path / expected


def test_safe_join_refuses_a_symlinked_parent(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "link").symlink_to(tmp_path.parent)
    with pytest.raises(DeviceError, match="outside"):
        safe_join(tmp_path / "out", "link/x.ips")


def test_names_are_flattened_and_cleaned() -> None:
    assert flat_name("/Retired/JetsamEvent-1.ips") == "Retired_JetsamEvent-1.ips"
    assert flat_name("../../../") == "_"
    assert clean_component("a\x00b\x1bc") == "a_b_c"
    assert clean_component("...") == "___"


def test_syslog_stream_sees_a_line(emulator: Emulator) -> None:
    loop, emit = emulator.host.loop, emulator.device.syslog.emit
    for i in range(1, 10):  # some land after the relay is subscribed, whenever that is
        loop.call_soon_threadsafe(loop.call_later, 0.3 * i, emit, "KVSoak", "kvrig-syslog-probe")
    lines = run(on_device(emulator.udid, lambda d: syslog.stream(d, 3.0, contains="kvrig-syslog-probe")))
    assert lines and all("kvrig-syslog-probe" in line for line in lines)
    assert any("KVSoak" in line for line in lines)


def test_a_report_a_computer_synced_is_listed_and_is_not_new(emulator: Emulator) -> None:
    """iOS adds `.synced` to a report once Finder or Xcode has copied it: such a JetsamEvent report is one (it was
    missed), and an old report renamed so during a soak is not this run's."""
    store = emulator.device.state.crash
    (store / "JetsamEvent-2026-03-03-000000.ips.synced").write_text('{"bug_type":"298"}\n{}\n')
    (store / "JetsamEvent-2026-03-03-000000.ips.old").write_text("not a report")
    try:
        jetsam = run(on_device(emulator.udid, crash.list_jetsam_reports))
    finally:
        (store / "JetsamEvent-2026-03-03-000000.ips.synced").unlink()
        (store / "JetsamEvent-2026-03-03-000000.ips.old").unlink()
    assert "/JetsamEvent-2026-03-03-000000.ips.synced" in jetsam
    assert "/JetsamEvent-2026-03-03-000000.ips.old" not in jetsam
    before = {"/JetsamEvent-1.ips", "/App-1.ips"}
    listed = ["/JetsamEvent-1.ips.synced", "/App-1.ips", "/JetsamEvent-2.ips", "/JetsamEvent-3.ips.synced"]
    assert crash.filed_since(listed, before) == ["/JetsamEvent-2.ips", "/JetsamEvent-3.ips.synced"]


def test_flush_closes_the_movers_connection(emulator: Emulator) -> None:
    # A lab flushes once per run: each connection left to the garbage collector is a socket held open meanwhile
    # (for good, where a reference cycle keeps it), and Python says so with a ResourceWarning.
    async def job(device):  # type: ignore[no-untyped-def]
        gc.collect()  # what earlier tests on this worker left (event loops) is not this test's to judge
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            for _ in range(3):
                await crash.flush(device)
            gc.collect()
        connections = ("StreamWriter", "socket", "transport")
        return [
            str(w.message)
            for w in caught
            if issubclass(w.category, ResourceWarning) and any(c in str(w.message) for c in connections)
        ]

    assert run(on_device(emulator.udid, job)) == []
