"""Running the emulator: in the foreground (`serve`, what `kvrig virtual start` runs) or on a background
thread with its own event loop (`EmulatorHost`, what tests and library users embed).

Both answer the emulator's control messages on the usbmuxd socket (`Kvrig*`), so a second
`kvrig virtual start` on the same socket adds its device to the running server, and `stop`/`status` work
from another process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import plistlib
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from pymobiledevice3.usbmux import UsbmuxdResult

from kvrig.virtual.device import VirtualDevice
from kvrig.virtual.faults import FaultPlan
from kvrig.virtual.usbmuxd import UsbmuxServer, result_message

T = TypeVar("T")


def device_from_options(options: dict[str, Any]) -> VirtualDevice:
    return VirtualDevice(
        Path(options["State"]),
        profile=options.get("Profile", "iPhone16,1"),
        ios=options.get("IOS", "16.7"),
        limit_bytes=options.get("LimitBytes"),
        baseline_bytes=options.get("BaselineBytes"),
        faults=FaultPlan.from_json(options.get("Faults") or {}),
    )


def _find(server: UsbmuxServer, request: dict[str, Any]) -> VirtualDevice | None:
    if request.get("UDID"):
        return server.device_by_udid(str(request["UDID"]))
    if request.get("State"):
        wanted = Path(str(request["State"])).resolve()
        for device in server.devices.values():
            if device.state.root.resolve() == wanted:
                return device
    return None


def server_status(server: UsbmuxServer) -> dict[str, Any]:
    """What `kvrig virtual status` reads: the server's process, addresses and devices."""
    return {
        "Pid": os.getpid(),
        "Address": server.address,
        **({"TcpAddress": server.tcp_address} if server.tcp_address else {}),
        "Devices": [d.status() for d in server.devices.values()],
    }


def control_handler(server_ref: list[UsbmuxServer], stop: asyncio.Event) -> Callable[..., Awaitable[Any]]:
    async def handle(request: dict[str, Any]) -> dict[str, Any]:
        server = server_ref[0]
        kind = request["MessageType"]
        if kind == "KvrigStatus":
            return server_status(server)
        if kind == "KvrigAddDevice":
            if _find(server, {"State": request["State"]}) is not None:
                raise ValueError(f"a device with state {request['State']} is already running")
            added = device_from_options(request)
            await server.add_device(added)
            return result_message(UsbmuxdResult.OK, UDID=added.identity.udid)
        if kind == "KvrigShutdown":
            stop.set()
            return result_message(UsbmuxdResult.OK)
        device = _find(server, request)
        if device is None:
            return result_message(UsbmuxdResult.BADDEV, Error="no such virtual device")
        if kind == "KvrigRemoveDevice":
            await server.remove_device(device)
            if not server.devices:
                stop.set()
        elif kind == "KvrigSetFaults":
            device.faults = FaultPlan.from_json(request.get("Faults") or {})
        elif kind == "KvrigReplug":
            await device.replug()
        else:
            raise ValueError(f"unknown control message {kind}")
        return result_message(UsbmuxdResult.OK)

    return handle


async def serve(
    address: str,
    devices: list[VirtualDevice],
    *,
    ready: Callable[[dict[str, Any]], None] | None = None,
    tcp: str | None = None,
) -> None:
    """Serves until a KvrigShutdown, the last device is removed, or cancellation (on a TCP port too, with `tcp`).
    `ready` gets the server's status once every device is on it."""
    stop = asyncio.Event()
    ref: list[UsbmuxServer] = []
    server = UsbmuxServer(address, control=control_handler(ref, stop), tcp=tcp)
    ref.append(server)
    await server.start()
    try:
        for device in devices:
            await server.add_device(device)
        if ready is not None:
            ready(server_status(server))
        await stop.wait()
    finally:
        await server.close()


class EmulatorHost:
    """A usbmuxd server and its devices on a background thread; use as a context manager."""

    def __init__(self, address: str, *, tcp: str | None = None) -> None:
        self.address = address
        self.tcp = tcp
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self.server: UsbmuxServer | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvrig-virtual", daemon=True)

    def run(self, coro: Awaitable[T], timeout: float | None = 60) -> T:
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return future.result(timeout)

    def start(self) -> EmulatorHost:
        self._thread.start()

        async def boot() -> None:
            self._stop = asyncio.Event()
            ref: list[UsbmuxServer] = []
            self.server = UsbmuxServer(self.address, control=control_handler(ref, self._stop), tcp=self.tcp)
            ref.append(self.server)
            await self.server.start()

        self.run(boot())
        return self

    def add_device(self, state_dir: str | Path, **kwargs: Any) -> VirtualDevice:
        async def create() -> VirtualDevice:
            device = VirtualDevice(state_dir, **kwargs)
            assert self.server is not None
            await self.server.add_device(device)
            return device

        return self.run(create())

    def stop(self) -> None:
        if self.server is not None:
            self.run(self.server.close())
            self.server = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def __enter__(self) -> EmulatorHost:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_foreground(address: str, options: dict[str, Any], on_ready: Any = None) -> None:
    """Serves one virtual iPhone made from `options` (control.device_options) until it is stopped."""
    device = device_from_options(options)
    asyncio.run(serve(address, [device], ready=on_ready, tcp=options.get("Tcp")))


if __name__ == "__main__":
    # The detached server control.start launches: `python -m kvrig.virtual.host ADDRESS HEX-PLIST-OPTIONS`.
    serve_foreground(sys.argv[1], plistlib.loads(bytes.fromhex(sys.argv[2])))
