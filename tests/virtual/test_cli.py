"""The pymobiledevice3 command line against the emulator, and `kvrig virtual start|status|stop` with state
that survives a restart."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.virtual.conftest import BUNDLE_ID, Emulator, make_ipa

PYMOBILEDEVICE3 = [sys.executable, "-m", "pymobiledevice3"]


def pmd3(emulator: Emulator, *args: str, timeout: float = 60) -> str:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=emulator.address, PYMOBILEDEVICE3_UDID=emulator.udid)
    result = subprocess.run(
        [*PYMOBILEDEVICE3, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    assert result.returncode == 0, f"pymobiledevice3 {' '.join(args)}: {result.stdout}\n{result.stderr}"
    return result.stdout


def test_usbmux_list_and_lockdown_info(emulator: Emulator) -> None:
    listed = json.loads(pmd3(emulator, "usbmux", "list"))
    assert {d["UniqueDeviceID"] for d in listed} == {emulator.udid, emulator.ios17.identity.udid}
    info = json.loads(pmd3(emulator, "lockdown", "info"))
    assert info["ProductType"] == "iPhone16,1" and info["UniqueDeviceID"] == emulator.udid


def test_apps_install_list_afc_and_dvt(emulator: Emulator, tmp_path: Path) -> None:
    ipa = make_ipa(tmp_path / "KVSoak.ipa")
    pmd3(emulator, "apps", "install", str(ipa))
    assert BUNDLE_ID in json.loads(pmd3(emulator, "apps", "list"))
    assert "/DCIM" in pmd3(emulator, "afc", "ls", "/").split()
    launched = pmd3(emulator, "developer", "dvt", "launch", f"{BUNDLE_ID} --max-tokens 256 --layers 2")
    pid = int(re.search(r"pid (\d+)", launched).group(1))  # type: ignore[union-attr]
    assert emulator.device.apps.pid_for_bundle(BUNDLE_ID) == pid
    pmd3(emulator, "developer", "dvt", "kill", str(pid))
    process = emulator.host.run(emulator.device.apps.wait(pid, 20))
    assert process.outcome == "killed"


def test_crash_ls_and_pull(emulator: Emulator, tmp_path: Path) -> None:
    (emulator.device.state.crash / "JetsamEvent-2026-01-02-030405.ips").write_text('{"bug_type":"298"}\n{}\n')
    assert "/JetsamEvent-2026-01-02-030405.ips" in pmd3(emulator, "crash", "ls").split()
    pmd3(emulator, "crash", "pull", str(tmp_path / "out"))
    assert (tmp_path / "out" / "JetsamEvent-2026-01-02-030405.ips").exists()


def test_syslog_live_streams_for_a_few_seconds(emulator: Emulator) -> None:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=emulator.address, PYMOBILEDEVICE3_UDID=emulator.udid)
    proc = subprocess.Popen(
        [*PYMOBILEDEVICE3, "syslog", "live"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    # Read until the device's own lines arrive: the client's start-up alone can take seconds on a loaded machine.
    out = ""
    watchdog = threading.Timer(60, proc.kill)  # readline would wait forever on a silent client
    watchdog.start()
    try:
        assert proc.stdout is not None
        while "SpringBoard" not in out:
            line = proc.stdout.readline()
            if not line:
                break
            out += line
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "SpringBoard" in out  # the device's own log lines arrived


def kvrig(*args: str, timeout: float = 90, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrig", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def start(address: str, state: Path, *options: str) -> dict:
    """`kvrig virtual start --json` on `address`; the phone it started."""
    started = kvrig("virtual", "start", "--socket", address, "--state", str(state), *options, "--json")
    assert started.returncode == 0, started.stderr
    return json.loads(started.stdout)


def pymobiledevice3(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=address)
    return subprocess.run([*PYMOBILEDEVICE3, *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_kvrig_virtual_start_detach_status_stop_and_restart(tmp_path: Path) -> None:
    address = f"/tmp/kvrig-cli-{os.getpid()}.sock"
    state = tmp_path / "state"
    try:
        first = start(address, state, "--limit-mb", "300", "--detach")
        assert first["socket"] == address and first["limit_bytes"] == 300 * 1024 * 1024
        status = json.loads(kvrig("virtual", "status", "--socket", address, "--json").stdout)
        assert [d["udid"] for d in status["Devices"]] == [first["udid"]]

        # a second device joins the same socket
        assert start(address, tmp_path / "s2", "--ios", "17.4")["ios"] == "17.4"
        assert kvrig("virtual", "stop", "--socket", address, "--state", str(tmp_path / "s2")).returncode == 0

        ipa = make_ipa(tmp_path / "KVSoak.ipa")
        run = pymobiledevice3(address, "apps", "install", str(ipa))
        assert run.returncode == 0, run.stderr
        assert kvrig("virtual", "stop", "--socket", address).returncode == 0
        assert kvrig("virtual", "status", "--socket", address).returncode == 11  # DeviceNotFoundError

        # restart on the same state: same UDID, the app is still installed
        assert start(address, state, "--detach")["udid"] == first["udid"]
        listed = pymobiledevice3(address, "apps", "list", "--type", "User")
        assert BUNDLE_ID in json.loads(listed.stdout)
    finally:
        kvrig("virtual", "stop", "--socket", address)


def test_kvrig_virtual_start_json_in_the_foreground(tmp_path: Path) -> None:
    """--json without --detach printed the shell line, not JSON: one JSON object once the socket answers."""
    address = f"/tmp/kvrig-fg-{os.getpid()}.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvrig",
            "virtual",
            "start",
            "--socket",
            address,
            "--state",
            str(tmp_path / "s"),
            "--tcp",
            "127.0.0.1:0",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        status = json.loads(kvrig("virtual", "status", "--socket", address, "--json").stdout)
        assert len(status["Devices"]) == 1
        # What the detached form prints: the addresses (the TCP port the server picked) and the phone.
        assert first == {
            "socket": address,
            "tcp": status["TcpAddress"],
            "usbmuxd_socket_address": f"UNIX:{address}",
            "pid": proc.pid,
            **status["Devices"][0],
        }
        assert first["product_type"] == "iPhone16,1" and first["limit_bytes"] > 0
        assert not status["TcpAddress"].endswith(":0")
    finally:
        kvrig("virtual", "stop", "--socket", address)
        proc.wait(timeout=60)


def test_kvrig_virtual_status_without_server_is_a_clear_error(tmp_path: Path) -> None:
    result = kvrig("virtual", "status", "--socket", str(tmp_path / "nothing.sock"))
    assert result.returncode == 11
    assert "no virtual iPhone server" in result.stderr and "Traceback" not in result.stderr


def test_a_wrong_profile_or_a_busy_state_folder_is_refused_at_once(tmp_path: Path) -> None:
    """--detach with an unknown profile waited a minute for a server that had died logging it; a second phone on a
    running phone's state folder was exit 10 (talking to a phone failed)."""
    address = str(tmp_path / "v.sock")
    began = time.monotonic()
    wrong = kvrig(
        "virtual", "start", "--socket", address, "--state", str(tmp_path / "a"), "--profile", "iPhone99,1", "--detach"
    )
    assert wrong.returncode == 3 and "unknown device profile 'iPhone99,1'" in wrong.stderr
    assert time.monotonic() - began < 30 and not Path(address).exists()
    first = kvrig("virtual", "start", "--socket", address, "--state", str(tmp_path / "a"), "--detach")
    assert first.returncode == 0, first.stderr
    try:
        again = kvrig("virtual", "start", "--socket", address, "--state", str(tmp_path / "a"))
        assert again.returncode == 3 and "--state" in again.stderr and "already" in again.stderr
        joined = kvrig("virtual", "start", "--socket", address, "--state", str(tmp_path / "b"), "--profile", "nope")
        assert joined.returncode == 3 and "unknown device profile 'nope'" in joined.stderr
    finally:
        kvrig("virtual", "stop", "--socket", address)


@pytest.fixture(scope="module")
def state_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual phone's state folder as `kvrig virtual start` leaves it (the phone stopped)."""
    root = tmp_path_factory.mktemp("state")
    address = str(root / "v.sock")
    started = kvrig("virtual", "start", "--socket", address, "--state", str(root / "s"), "--detach")
    assert started.returncode == 0, started.stderr
    stopped = kvrig("virtual", "stop", "--socket", address, "--json")
    assert stopped.returncode == 0 and json.loads(stopped.stdout) == {"socket": address, "stopped": "all"}
    assert not Path(address).exists()
    assert (root / "s" / "device.json").is_file() and (root / "s" / "pairing" / "pairing.plist").is_file()
    return root / "s"


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("device.json", b'{"udid": "0000'),  # cut short
        ("device.json", b'{"udid": "x", "colour": "red"}'),  # not this kvrig's record
        ("developer.json", b"[1, 2]"),
        ("apps.json", b'{"com.example.app": 3}'),
        ("pairing/pairing.plist", b"<?xml version='1.0'?><plist><dict><key>"),
    ],
)
def test_a_damaged_state_folder_is_refused_naming_the_file(
    state_folder: Path, tmp_path: Path, name: str, data: bytes
) -> None:
    """State files kvrig wrote and something cut short or edited: exit 3 naming the file, never a traceback."""
    import shutil

    state = tmp_path / "s"
    shutil.copytree(state_folder, state)
    (state / name).write_bytes(data)
    address = str(tmp_path / "v.sock")
    result = kvrig("virtual", "start", "--socket", address, "--state", str(state), "--detach")
    assert result.returncode == 3, result.stderr
    assert str(state / name) in result.stderr and "--state" in result.stderr and "Traceback" not in result.stderr
    assert not Path(address).exists()


@pytest.mark.parametrize("ios", ["15.0"])
def test_kvrig_virtual_rejects_unknown_ios(tmp_path: Path, ios: str) -> None:
    result = kvrig("virtual", "start", "--socket", str(tmp_path / "x.sock"), "--state", str(tmp_path), "--ios", ios)
    assert result.returncode == 2 and "17.4" in result.stderr


@pytest.mark.parametrize("fault", ["--stall-handshake", "--rsd-silent"])
def test_kvrig_virtual_refuses_a_tunnel_fault_on_a_phone_without_tunnel(tmp_path: Path, fault: str) -> None:
    address = str(tmp_path / "t.sock")
    result = kvrig("virtual", "start", "--socket", address, "--state", str(tmp_path / "s"), fault)
    assert result.returncode == 49, result.stderr
    assert "CoreDeviceProxy" in result.stderr and "Traceback" not in result.stderr


def test_kvrig_virtual_start_on_a_socket_another_server_holds(tmp_path: Path) -> None:
    address = f"/tmp/kvrig-busy-{os.getpid()}.sock"
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(address)
        other.listen(4)
        result = kvrig("virtual", "start", "--socket", address, "--state", str(tmp_path / "s"), timeout=60)
    finally:
        other.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)
    assert result.returncode == 48, result.stderr
    assert "already listening" in result.stderr and "Traceback" not in result.stderr


def test_kvrig_virtual_status_shows_developer_state(tmp_path: Path) -> None:
    address = f"/tmp/kvrig-dev-{os.getpid()}.sock"
    try:
        device = start(address, tmp_path / "s", "--ios", "18.6", "--image-missing", "--detach")
        assert (device["ios"], device["developer_mode"], device["image_mounted"]) == ("18.6", True, False)
        assert Path(device["ddi"]["image"]).is_file()
        table = kvrig("virtual", "status", "--socket", address, env=dict(os.environ, COLUMNS="250"))  # unwrapped
        row = next(line for line in table.stdout.splitlines() if device["udid"] in line)
        assert "18.6" in row and "missing" in row and " on " in row
    finally:
        kvrig("virtual", "stop", "--socket", address)


def test_kvrig_virtual_start_ios_27_driven_by_both_clients(tmp_path: Path) -> None:
    """`kvrig virtual start --ios 27.2`, then the pymobiledevice3 CLI (lockdown values; the no-root userspace tunnel
    it falls back to by itself for a developer command) and libimobiledevice's ideviceinfo."""
    address = f"/tmp/kvrig-cli27-{os.getpid()}.sock"
    try:
        phone = start(address, tmp_path / "s27", "--ios", "27.2", "--detach")
        assert phone["ios"] == "27.2"
        env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=address, PYMOBILEDEVICE3_UDID=phone["udid"])
        env.pop("PYMOBILEDEVICE3_DEFAULT_FALLBACK", None)
        values = subprocess.run(
            [*PYMOBILEDEVICE3, "lockdown", "info"], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert values.returncode == 0, values.stderr
        info = json.loads(values.stdout)
        assert (info["ProductVersion"], info["BuildVersion"]) == ("27.2", "24B5099f")  # AppleDB's 27.2 seed build
        processes = subprocess.run(
            [*PYMOBILEDEVICE3, "developer", "dvt", "proclist"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert processes.returncode == 0, processes.stderr
        assert "launchd" in processes.stdout
        if shutil.which("ideviceinfo") is None and not sys.platform.startswith("linux"):
            pytest.skip("libimobiledevice's ideviceinfo missing (brew install libimobiledevice)")
        idevice = subprocess.run(
            ["ideviceinfo", "-u", phone["udid"], "-k", "BuildVersion"],
            env=dict(os.environ, USBMUXD_SOCKET_ADDRESS=f"UNIX:{address}"),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert idevice.returncode == 0 and idevice.stdout.strip() == "24B5099f", idevice.stderr
    finally:
        kvrig("virtual", "stop", "--socket", address)
