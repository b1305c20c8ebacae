"""One `USBMUXD_SOCKET_ADDRESS` for every client: libimobiledevice's tools read `UNIX:/path` or HOST:PORT,
pymobiledevice3 a bare path or HOST:PORT. kvrig takes all three and prints the `UNIX:` form, which both
libimobiledevice (checked with its own `idevice_id`) and kvrig then read."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrig.device.address import usbmux_address
from kvrig.exceptions import UsbmuxAddressError

ROOT = Path(__file__).resolve().parents[2]


def kvrig(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


@pytest.mark.parametrize(
    ("text", "dialled"),
    [("UNIX:/tmp/v.sock", "/tmp/v.sock"), ("/tmp/v.sock", "/tmp/v.sock"), ("10.0.0.5:27015", "10.0.0.5:27015")],
)
def test_the_forms_both_clients_read(text: str, dialled: str) -> None:
    assert usbmux_address(text) == dialled


@pytest.mark.parametrize(
    "text", ["UNIX:", "nohostport", "host:port", "host:99999", ":27015", "[::1]:27015", "::1:27015"]
)
def test_other_values_name_the_variable(text: str) -> None:
    with pytest.raises(UsbmuxAddressError) as info:
        usbmux_address(text)
    assert info.value.field == "USBMUXD_SOCKET_ADDRESS" and repr(text) in str(info.value)


def test_ipv6_is_refused_because_pymobiledevice3_cannot_dial_it() -> None:
    """The refusal stands on the client's behaviour: when pymobiledevice3 learns IPv6, this fails and the
    refusal can go."""
    from pymobiledevice3 import usbmux

    for address in ("[::1]:27015", "::1:27015"):
        with pytest.raises(ValueError):
            asyncio.run(usbmux.create_mux(usbmux_address=address))
        with pytest.raises(UsbmuxAddressError, match="IPv6"):
            usbmux_address(address)


def test_a_bad_variable_is_exit_51_before_anything_is_dialled() -> None:
    proc = kvrig("devices", env=dict(os.environ, USBMUXD_SOCKET_ADDRESS="host:port"))
    assert proc.returncode == 51, proc.stderr
    assert "USBMUXD_SOCKET_ADDRESS" in proc.stderr and "Traceback" not in proc.stderr


def test_the_printed_address_serves_libimobiledevice_and_kvrig(tmp_path: Path) -> None:
    socket_path = f"/tmp/kvrig-addr-{os.getpid()}.sock"
    started = kvrig("virtual", "start", "--socket", socket_path, "--state", str(tmp_path / "s"), "--detach")
    try:
        assert started.returncode == 0, started.stderr
        exported = [line for line in started.stdout.splitlines() if line.startswith("USBMUXD_SOCKET_ADDRESS=")]
        assert exported == [f"USBMUXD_SOCKET_ADDRESS=UNIX:{socket_path}"]
        env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=exported[0].split("=", 1)[1])
        udid = started.stdout.splitlines()[-1].split()[0]
        ids = subprocess.run(["idevice_id", "-l"], capture_output=True, text=True, env=env, timeout=60)
        assert ids.returncode == 0 and udid in ids.stdout.split(), ids.stderr
        listed = kvrig("devices", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert udid in listed.stdout
        # the same phone, the socket named in libimobiledevice's form on kvrig's own option
        assert kvrig("virtual", "status", "--socket", f"UNIX:{socket_path}").returncode == 0
    finally:
        kvrig("virtual", "stop", "--socket", socket_path)


def test_a_socket_path_too_long_for_the_system_is_refused_before_anything_binds(tmp_path: Path) -> None:
    """The kernel's own limit is the check: one byte under it binds, the refused length does not. On macOS it is
    104 bytes, and a path under $TMPDIR (/var/folders/...) easily passes it: the server died with only a log line."""
    import socket

    from kvrig.device.address import MAX_SOCKET_PATH

    base = f"{tmp_path}/"
    if len(base) >= MAX_SOCKET_PATH - 8:
        pytest.skip(f"the temporary folder's path ({len(base)} bytes) leaves no room to build one under it")
    longest = base + "a" * (MAX_SOCKET_PATH - 1 - len(base))
    assert usbmux_address(longest) == longest
    with socket.socket(socket.AF_UNIX) as ok:
        ok.bind(longest)
    too_long = longest + "a"
    with socket.socket(socket.AF_UNIX) as refused, pytest.raises(OSError):
        refused.bind(too_long)
    with pytest.raises(UsbmuxAddressError, match=f"at most {MAX_SOCKET_PATH - 1}") as info:
        usbmux_address(f"UNIX:{too_long}", field="--socket")
    assert info.value.field == "--socket" and info.value.exit_code == 51
