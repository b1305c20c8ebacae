"""Driving an emulator server from another process through its usbmuxd socket: start one (in the foreground
or detached), add a device to a running one, ask its status, stop a device or the whole server."""

from __future__ import annotations

import os
import plistlib
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvrig.exceptions import DeviceError, DeviceNotFoundError, InputError, VirtualPhoneError
from kvrig.profiles import load_profile
from kvrig.virtual.faults import FaultPlan
from kvrig.virtual.pairing import Pairing
from kvrig.virtual.state import DeviceState, Identity, state_record

HEADER = struct.Struct("<IIII")
DEFAULT_SOCKET = "/tmp/kvrig-virtual-usbmuxd.sock"
START_TIMEOUT_S = 60.0


def _connect(address: str, timeout: float) -> socket.socket:
    if ":" in address:
        host, port = address.rsplit(":", 1)
        return socket.create_connection((host, int(port)), timeout=timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(address)
    return sock


def send_control(address: str, message: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
    """One request/reply on the usbmuxd socket."""
    try:
        sock = _connect(address, timeout)
    except OSError as exc:
        raise DeviceNotFoundError(f"no virtual iPhone server at {address} ({exc.strerror or exc})") from None
    try:
        with sock:
            body = plistlib.dumps(message)
            sock.sendall(HEADER.pack(HEADER.size + len(body), 1, 8, 1) + body)
            header = _recv(sock, HEADER.size)
            length = HEADER.unpack(header)[0]
            reply = plistlib.loads(_recv(sock, length - HEADER.size))
    except OSError as exc:
        raise DeviceError(f"virtual iPhone server at {address}: {exc}") from None
    if reply.get("Number", 0) != 0:
        raise DeviceError(f"virtual iPhone server at {address}: {reply.get('Error', 'request refused')}")
    return reply


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise DeviceError("the virtual iPhone server closed the connection")
        data += chunk
    return data


def server_alive(address: str) -> bool:
    try:
        # A kvrig server answers at once; something else on the socket may never answer.
        send_control(address, {"MessageType": "KvrigStatus"}, timeout=10)
        return True
    except DeviceError:
        return False


def device_options(
    state: Path,
    profile: str,
    ios: str,
    limit_bytes: int | None,
    faults: FaultPlan,
    baseline_bytes: int | None = None,
) -> dict[str, Any]:
    options: dict[str, Any] = {"State": str(state.resolve()), "Profile": profile, "IOS": ios}
    if limit_bytes is not None:
        options["LimitBytes"] = limit_bytes
    if baseline_bytes is not None:
        options["BaselineBytes"] = baseline_bytes
    options["Faults"] = {k: v for k, v in faults.to_json().items() if v not in (None, [])}
    return options


def start(
    address: str,
    state: Path,
    *,
    profile: str = "iPhone16,1",
    ios: str = "16.7",
    limit_bytes: int | None = None,
    baseline_bytes: int | None = None,
    faults: FaultPlan | None = None,
    detach: bool = False,
    on_ready: Any = None,
    tcp: str | None = None,
) -> dict[str, Any]:
    """Starts a virtual iPhone. With a server already on `address` the device joins it; with `detach` a
    background server starts; otherwise this call serves until stopped. Returns the device's status. A new
    server also listens on the TCP address `tcp` (HOST:PORT, port 0 picks one; `status` tells which)."""
    faults = faults or FaultPlan()
    faults.check(ios)
    load_profile(profile)  # here, not in a detached server that would only log it
    check_state(state)
    options = device_options(state, profile, ios, limit_bytes, faults, baseline_bytes)
    if tcp is not None:
        options["Tcp"] = tcp
    if server_alive(address):
        if any(Path(d["state"]).resolve() == state.resolve() for d in status(address)["Devices"]):
            raise InputError(
                f"a virtual iPhone on {address} runs from this folder already",
                file=state,
                field="--state",
                expected="another state folder for a second phone",
            )
        reply = send_control(address, {"MessageType": "KvrigAddDevice", **options})
        return _device_status(address, reply["UDID"])
    if detach:
        try:
            state.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create it: {exc.strerror or exc}", file=state, field="--state") from None
        log = open(state / "emulator.log", "ab")  # noqa: SIM115 - handed to the child process
        command = [sys.executable, "-m", "kvrig.virtual.host", address, plistlib.dumps(options).hex()]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")])
        )
        server = subprocess.Popen(
            command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if server_alive(address):
                return status(address)["Devices"][0]
            if server.poll() is not None:  # it died starting: no need to wait out the deadline
                raise VirtualPhoneError(
                    f"the virtual iPhone server exited ({server.returncode}); see {state}/emulator.log"
                )
            time.sleep(0.1)
        raise VirtualPhoneError(
            f"the virtual iPhone did not start within {START_TIMEOUT_S:.0f}s; see {state}/emulator.log"
        )
    # The emulator (pymobiledevice3 and every service) loads only in the process that serves it.
    from kvrig.virtual.host import serve_foreground

    serve_foreground(address, options, on_ready)
    return {}


def check_state(root: Path) -> None:
    """The records an existing state folder holds, read as the server will read them: InputError naming a damaged
    one here, before a detached server would only log it."""
    state = DeviceState(root)
    if (root / "device.json").exists():
        identity = state_record(root / "device.json", Identity)
        if (state.pairing_dir / "pairing.plist").exists():
            Pairing.load_or_create(state.pairing_dir, identity.wifi_mac)
    state.developer(), state.user_apps()


def _device_status(address: str, udid: str) -> dict[str, Any]:
    for device in status(address)["Devices"]:
        if device["udid"] == udid:
            return device
    raise DeviceNotFoundError(f"virtual device {udid} is not on {address}")


def status(address: str) -> dict[str, Any]:
    return send_control(address, {"MessageType": "KvrigStatus"})


def stop(address: str, state: Path | None = None, timeout_s: float = 20.0) -> None:
    """Stops one device (by state folder) or, without `state`, the whole server; waits until it is gone."""
    if state is not None:
        send_control(address, {"MessageType": "KvrigRemoveDevice", "State": str(state.resolve())})
    else:
        send_control(address, {"MessageType": "KvrigShutdown"})
    if state is None or not status_devices_safe(address):
        deadline = time.monotonic() + timeout_s
        while server_alive(address) and time.monotonic() < deadline:
            time.sleep(0.1)


def status_devices_safe(address: str) -> list[dict[str, Any]]:
    try:
        return list(status(address)["Devices"])
    except DeviceError:
        return []


def set_faults(address: str, udid: str, faults: FaultPlan) -> None:
    send_control(address, {"MessageType": "KvrigSetFaults", "UDID": udid, "Faults": faults.to_json()})
