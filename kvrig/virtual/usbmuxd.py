"""A usbmuxd-protocol server: lists the virtual devices, hands out their pair records and forwards a client's
socket to a device port (lockdownd on 62078, or a port lockdownd opened for a service).

Wire format (as libusbmuxd and pymobiledevice3 speak it): a 16-byte little-endian header (length, version,
message, tag) then, for version 1 / message 8, an XML plist. After a successful `Connect` the same socket
carries the device service's bytes. Messages starting with `Kvrig` are this emulator's own control channel
(status, add/remove a device, faults), used by `kvrig virtual`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import plistlib
import socket
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bytestruct import U32_LE
from pymobiledevice3.usbmux import (
    UsbmuxdHeader,
    UsbmuxdMessageType,
    UsbmuxdResult,
    UsbmuxdResultData,
    UsbmuxdVersion,
    build_usbmuxd_request,
)

from kvrig.exceptions import VirtualPhoneError
from kvrig.virtual.device import VirtualDevice

log = logging.getLogger(__name__)

# The header layout, message types and result codes are pymobiledevice3's (a client these serve).
HEADER_SIZE = U32_LE.size + len(UsbmuxdHeader(0, 0, 0).build())  # the length prefix, then version, message, tag
MAX_PACKET = 1 << 20
APPLE_USB_PRODUCT_ID = 0x12A8

ControlHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _packet(payload: dict[str, Any], tag: int) -> bytes:
    return build_usbmuxd_request(UsbmuxdVersion.PLIST, UsbmuxdMessageType.PLIST, tag, plistlib.dumps(payload))


def result_message(number: UsbmuxdResult, **extra: Any) -> dict[str, Any]:
    """A plist `Result` answer with one of usbmuxd's result numbers (and any extra keys)."""
    return {"MessageType": "Result", "Number": int(number), **extra}


class UsbmuxServer:
    """Serves any number of virtual devices on one socket (a unix path, or HOST:PORT), and optionally on a
    TCP port as well (`tcp`: HOST:PORT, port 0 picks one; `tcp_address` is then the bound one), so another
    machine's controller reaches the same phones through `USBMUXD_SOCKET_ADDRESS=HOST:PORT`."""

    def __init__(self, address: str, *, control: ControlHandler | None = None, tcp: str | None = None) -> None:
        self.address = address
        self.tcp = tcp
        self.tcp_address: str | None = None
        self._tcp_server: asyncio.AbstractServer | None = None
        self.control = control
        self.devices: dict[int, VirtualDevice] = {}
        self.buid = str(uuid.uuid4()).upper()
        self._next_device_id = 1
        self._listeners: set[asyncio.Queue[dict[str, Any]]] = set()
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()

    # --- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        if ":" in self.address:
            host, port = self.address.rsplit(":", 1)
            self._server = await asyncio.start_server(self._on_client, host, int(port))
        else:
            path = Path(self.address)
            if path.exists():
                if _socket_alive(path):
                    raise VirtualPhoneError(f"{path}: another usbmuxd server is already listening there")
                path.unlink()
            self._server = await asyncio.start_unix_server(self._on_client, str(path))
        if self.tcp is not None:
            host, port = self.tcp.rsplit(":", 1)
            self._tcp_server = await asyncio.start_server(self._on_client, host, int(port))
            bound = self._tcp_server.sockets[0].getsockname()
            self.tcp_address = f"{host}:{bound[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._tcp_server is not None:
            self._tcp_server.close()
        for device in list(self.devices.values()):
            await device.shutdown()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        if ":" not in self.address:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address)

    async def add_device(self, device: VirtualDevice) -> int:
        device_id = self._next_device_id
        self._next_device_id += 1
        self.devices[device_id] = device
        device.attach(self, device_id)
        await device.start()
        if device.plugged:
            self.notify_attached(device)
        return device_id

    async def remove_device(self, device: VirtualDevice) -> None:
        for device_id, candidate in list(self.devices.items()):
            if candidate is device:
                del self.devices[device_id]
                self.notify_detached(device_id)
        await device.shutdown()

    def device_by_udid(self, udid: str) -> VirtualDevice | None:
        for device in self.devices.values():
            if device.identity.udid.replace("-", "") == udid.replace("-", ""):
                return device
        return None

    # --- notifications for Listen ----------------------------------------------------------------------

    def _broadcast(self, message: dict[str, Any]) -> None:
        for queue in self._listeners:
            queue.put_nowait(message)

    def notify_attached(self, device: VirtualDevice) -> None:
        self._broadcast(self._attached(device))

    def notify_detached(self, device_id: int) -> None:
        self._broadcast({"MessageType": "Detached", "DeviceID": device_id})

    def _attached(self, device: VirtualDevice) -> dict[str, Any]:
        udid = device.identity.udid
        if device.connection == "Network":  # the shape macOS's usbmuxd gives a Wi-Fi phone: no USB properties
            properties = {
                "ConnectionType": "Network",
                "DeviceID": device.device_id,
                "EscapedFullServiceName": f"{device.identity.wifi_mac}@fe80::1._apple-mobdev2._tcp.local.",
                "InterfaceIndex": 14,
                "NetworkAddress": bytes(128),
                "SerialNumber": udid,
            }
            return {"MessageType": "Attached", "DeviceID": device.device_id, "Properties": properties}
        return {
            "MessageType": "Attached",
            "DeviceID": device.device_id,
            "Properties": {
                "ConnectionSpeed": 480000000,
                "ConnectionType": "USB",
                "DeviceID": device.device_id,
                "LocationID": 0x01100000 + device.device_id,
                "ProductID": APPLE_USB_PRODUCT_ID,
                "SerialNumber": udid,
                "USBSerialNumber": udid.replace("-", ""),
            },
        }

    # --- one client connection -------------------------------------------------------------------------

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve_client(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("usbmuxd connection failed")
        finally:
            self._connections.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            header = await reader.readexactly(HEADER_SIZE)
            length = U32_LE.unpack(header[: U32_LE.size])[0]
            if length < HEADER_SIZE or length > MAX_PACKET:
                return  # not usbmuxd protocol: real usbmuxd drops such a client
            fields = UsbmuxdHeader.parse(header[U32_LE.size :])
            body = await reader.readexactly(length - HEADER_SIZE)
            if fields.version != UsbmuxdVersion.PLIST or fields.message != UsbmuxdMessageType.PLIST:
                # The binary protocol is not spoken here; clients retry with plists on BADVERSION.
                result = UsbmuxdResultData(UsbmuxdResult.BADVERSION).build()
                writer.write(build_usbmuxd_request(fields.version, UsbmuxdMessageType.RESULT, fields.tag, result))
                await writer.drain()
                continue
            tag = fields.tag
            try:
                request = plistlib.loads(body)
                kind = request["MessageType"]
            except Exception:
                await self._reply(writer, tag, result_message(UsbmuxdResult.BADCOMMAND))
                continue
            if kind == "Listen":
                await self._reply(writer, tag, result_message(UsbmuxdResult.OK))
                await self._listen(writer)
                return
            if kind == "Connect":
                handed_over = await self._connect(request, tag, reader, writer)
                if handed_over:
                    return
                continue
            await self._reply(writer, tag, await self._answer(kind, request))

    async def _reply(self, writer: asyncio.StreamWriter, tag: int, payload: dict[str, Any]) -> None:
        writer.write(_packet(payload, tag))
        await writer.drain()

    async def _answer(self, kind: str, request: dict[str, Any]) -> dict[str, Any]:
        if kind == "ReadBUID":
            return {"BUID": self.buid}
        if kind == "ListDevices":
            return {"DeviceList": [self._attached(d) for d in self.devices.values() if d.plugged]}
        if kind == "ReadPairRecord":
            device = self.device_by_udid(str(request.get("PairRecordID", "")))
            if device is None or device.faults.untrusted:  # usbmuxd answers ENOENT (2) for a record it lacks
                return result_message(UsbmuxdResult.BADDEV)
            return {"PairRecordData": plistlib.dumps(device.pairing.pair_record())}
        if kind in ("SavePairRecord", "DeletePairRecord"):
            # Pairing of a new host is not emulated; the record the emulator generated stays authoritative.
            return result_message(UsbmuxdResult.OK)
        if kind.startswith("Kvrig") and self.control is not None:
            try:
                return await self.control(request)
            except Exception as exc:
                return result_message(UsbmuxdResult.BADCOMMAND, Error=str(exc))
        return result_message(UsbmuxdResult.BADCOMMAND)

    async def _listen(self, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for device in self.devices.values():
            if device.plugged:
                queue.put_nowait(self._attached(device))
        self._listeners.add(queue)
        try:
            while True:
                await self._reply(writer, 0, await queue.get())
        finally:
            self._listeners.discard(queue)

    async def _connect(
        self, request: dict[str, Any], tag: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        device = self.devices.get(int(request.get("DeviceID", -1)))
        if device is None or not device.plugged:
            await self._reply(writer, tag, result_message(UsbmuxdResult.BADDEV))
            return False
        # PortNumber travels in network byte order inside the plist.
        port = socket.ntohs(int(request.get("PortNumber", 0)) & 0xFFFF)
        handler = device.take_port(port)
        if handler is None:
            await self._reply(writer, tag, result_message(UsbmuxdResult.CONNREFUSED))
            return False
        await self._reply(writer, tag, result_message(UsbmuxdResult.OK))
        await device.serve(handler, reader, writer)
        return True


def _socket_alive(path: Path) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()
