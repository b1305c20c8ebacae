"""DTX, the instruments protocol, server side: the DVT secure-socket proxy with process control.

Wire format (little-endian): every message travels in fragments with a 32-byte header (magic 0x1F3D5B79,
header size, fragment index and count, data size, message identifier, conversation index, channel code,
flags; bit 0 of flags asks for a reply). A message body is a 16-byte payload header (type, aux size, total
size), then the aux arguments as a "primitive dictionary" (NULL keys, typed values; objects travel as
NSKeyedArchiver buffers), then the payload (a DISPATCH carries the archived selector string).

Channel 0 is the control channel: each side announces `_notifyOfPublishedCapabilities:`, the client opens
a service with `_requestChannelWithCode:identifier:`. Replies keep the request's identifier with
conversation index 1 and are OK (no value), OBJECT (archived value) or ERROR (archived NSError). A message
the device sends on a channel the client opened carries the negated channel code.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import struct
from collections.abc import Callable
from typing import Any

from bpylist2 import archiver

from toolchain.virtual.apprun import AppLaunchError
from toolchain.virtual.wire import Link, ProtocolViolation

log = logging.getLogger(__name__)

MAGIC = 0x1F3D5B79
FRAGMENT = struct.Struct("<IIHHIIIiI")
PAYLOAD_HEADER = struct.Struct("<BBBBIII")
EXPECTS_REPLY = 1
MAX_MESSAGE = 32 * 1024 * 1024

OK, OBJECT, DISPATCH, ERROR = 0, 3, 2, 4
P_STRING, P_BUFFER, P_INT32, P_INT64, P_DOUBLE, P_NULL, P_DICT = 1, 2, 3, 6, 9, 10, 0xF0

PROCESS_CONTROL = "com.apple.instruments.server.services.processcontrol"
DEVICE_INFO = "com.apple.instruments.server.services.deviceinfo"
PROCESS_CONTROL_DOMAIN = "com.apple.dt.deviceprocesscontrolservice"
TRANSIENT_LAUNCH_ERROR = 1  # the code of the transient launch failure the launch-error fault injects
# Limit a process gets after requestDisableMemoryLimitsForPid: (the per-process limit is waived).
NO_LIMIT_BYTES = 1 << 40


class NSError:
    """An NSError to archive in an ERROR reply."""

    def __init__(self, code: int, domain: str, description: str) -> None:
        self.code, self.domain, self.description = code, domain, description

    def encode_archive(self, obj: Any) -> None:
        obj.encode("NSDomain", self.domain)
        obj.encode("NSCode", self.code)
        obj.encode("NSUserInfo", {"NSLocalizedDescription": self.description})


# Archive-only registration: the unarchive map is shared with any DTX client in this process.
archiver.ARCHIVE_CLASS_MAP[NSError] = "NSError"


class DtxFailure(Exception):
    def __init__(self, error: NSError) -> None:
        super().__init__(error.description)
        self.error = error


# --- primitive dictionaries (aux) ---------------------------------------------------------------------


def decode_aux(data: bytes) -> list[Any]:
    if not data:
        return []
    if len(data) < 16:
        raise ProtocolViolation("aux shorter than its header")
    _magic, _flags, length = struct.unpack_from("<IIQ", data)
    pos, end, values = 16, 16 + length, []
    if end > len(data):
        raise ProtocolViolation("aux length past the message")

    def read() -> Any:
        nonlocal pos
        (tag,) = struct.unpack_from("<I", data, pos)
        pos += 4
        kind = tag & 0xFF
        if kind == P_NULL:
            return None
        if kind in (P_STRING, P_BUFFER):
            (n,) = struct.unpack_from("<I", data, pos)
            raw = data[pos + 4 : pos + 4 + n]
            pos += 4 + n
            if kind == P_STRING:
                return raw.decode(errors="replace")
            return archiver.unarchive(raw) if raw else None
        if kind == P_INT32:
            (v,) = struct.unpack_from("<i", data, pos)
            pos += 4
            return v
        if kind == P_INT64:
            (v,) = struct.unpack_from("<q", data, pos)
            pos += 8
            return v
        if kind == P_DOUBLE:
            (v,) = struct.unpack_from("<d", data, pos)
            pos += 8
            return v
        raise ProtocolViolation(f"unknown primitive type {tag:#x}")

    try:
        while pos < end:
            read()  # the key: NULL for positional arguments
            values.append(read())
    except (struct.error, ValueError) as exc:
        raise ProtocolViolation(f"malformed aux: {exc}") from exc
    return values


def encode_aux(args: list[Any]) -> bytes:
    if not args:
        return b""
    body = bytearray()
    for arg in args:
        body += struct.pack("<I", P_NULL)
        blob = archiver.archive(arg) if arg is not None else b""
        body += struct.pack("<II", P_BUFFER, len(blob)) + blob
    return struct.pack("<IIQ", 0x1F0, 0, len(body)) + bytes(body)


# --- the connection -----------------------------------------------------------------------------------


class DtxConnection:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.device = link.device
        self.channels: dict[int, str] = {0: "ctrl"}
        self._next_id = 1
        self._send_lock = asyncio.Lock()
        self._partial: dict[int, bytearray] = {}
        self.observed: set[int] = set()
        self._listener: Callable[[int, int | None, int | None], None] | None = None
        self._tasks: set[asyncio.Future[None]] = set()

    def _task_done(self, task: asyncio.Future[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("termination notice not delivered: %s", task.exception())

    async def send(
        self, msg_type: int, channel: int, identifier: int, conversation: int, *, payload: Any = None, aux=()
    ) -> None:
        payload_bytes = archiver.archive(payload) if payload is not None else b""
        aux_bytes = encode_aux(list(aux))
        body = (
            PAYLOAD_HEADER.pack(msg_type, 0, 0, 0, len(aux_bytes), len(aux_bytes) + len(payload_bytes), 0)
            + aux_bytes
            + payload_bytes
        )
        header = FRAGMENT.pack(MAGIC, FRAGMENT.size, 0, 1, len(body), identifier, conversation, channel, 0)
        async with self._send_lock:
            await self.link.send(header + body)

    async def notify(self, channel: int, selector: str, *args: Any) -> None:
        identifier = self._next_id
        self._next_id += 1
        wire_channel = -channel if channel else 0
        await self.send(DISPATCH, wire_channel, identifier, 0, payload=selector, aux=args)

    async def read_message(self) -> tuple[int, int, int, int, int, bytes, bytes]:
        """Next whole message: (type, identifier, conversation, channel, flags, aux, payload)."""
        while True:
            header = await self.link.recv_exactly(FRAGMENT.size)
            magic, header_size, index, count, size, identifier, conversation, channel, flags = FRAGMENT.unpack(header)
            if magic != MAGIC or header_size < FRAGMENT.size or size > MAX_MESSAGE:
                raise ProtocolViolation(f"bad DTX fragment header {header.hex()}")
            if header_size > FRAGMENT.size:
                await self.link.recv_exactly(header_size - FRAGMENT.size)
            if count > 1 and index == 0:
                self._partial[identifier] = bytearray()
                continue
            chunk = await self.link.recv_exactly(size)
            if count > 1:
                buffer = self._partial.setdefault(identifier, bytearray())
                buffer += chunk
                if index + 1 < count:
                    continue
                chunk = bytes(self._partial.pop(identifier))
            if len(chunk) < PAYLOAD_HEADER.size:
                raise ProtocolViolation("DTX message shorter than its payload header")
            msg_type, _a, _b, _c, aux_size, total, _flags = PAYLOAD_HEADER.unpack_from(chunk)
            if PAYLOAD_HEADER.size + total != len(chunk) or aux_size > total:
                raise ProtocolViolation("DTX payload sizes do not add up")
            aux = chunk[PAYLOAD_HEADER.size : PAYLOAD_HEADER.size + aux_size]
            payload = chunk[PAYLOAD_HEADER.size + aux_size :]
            return msg_type, identifier, conversation, channel, flags, aux, payload

    async def run(self) -> None:
        capabilities = {
            "com.apple.private.DTXConnection": 1,
            "com.apple.private.DTXBlockCompression": 0,
            PROCESS_CONTROL: 4,
            DEVICE_INFO: 1,
        }
        await self.notify(0, "_notifyOfPublishedCapabilities:", capabilities)
        try:
            while True:
                msg_type, identifier, conversation, channel, flags, aux, payload = await self.read_message()
                if msg_type != DISPATCH or conversation % 2 == 1:
                    continue  # replies to our notifications, and data we do not consume
                wants_reply = bool(flags & EXPECTS_REPLY)
                try:
                    selector = archiver.unarchive(payload) if payload else None
                    args = decode_aux(aux)
                except ProtocolViolation:
                    raise
                except Exception as exc:
                    raise ProtocolViolation(f"undecodable DTX message: {exc}") from exc
                try:
                    result = await self.dispatch(abs(channel), str(selector), args)
                except DtxFailure as failure:
                    if wants_reply:
                        await self.send(ERROR, channel, identifier, conversation + 1, payload=failure.error)
                    continue
                if wants_reply:
                    if result is None:
                        await self.send(OK, channel, identifier, conversation + 1)
                    else:
                        await self.send(OBJECT, channel, identifier, conversation + 1, payload=result)
        finally:
            if self._listener is not None:
                self.device.apps.termination_listeners.discard(self._listener)

    async def dispatch(self, channel: int, selector: str, args: list[Any]) -> Any:
        if channel == 0:
            if selector == "_requestChannelWithCode:identifier:":
                code, identifier = int(args[0]), str(args[1])
                if identifier not in (PROCESS_CONTROL, DEVICE_INFO):
                    raise DtxFailure(NSError(1, "DTXMessage", f"Unable to find service for {identifier}"))
                self.channels[code] = identifier
                if identifier == PROCESS_CONTROL:
                    self._watch_terminations(code)
                return None
            if selector == "_channelCanceled:":
                self.channels.pop(int(args[0]), None)
                return None
            return None  # _notifyOfPublishedCapabilities: and other control chatter
        service = self.channels.get(channel)
        if service == PROCESS_CONTROL:
            return await self.process_control(selector, args)
        if service == DEVICE_INFO:
            return self.device_info(selector, args)
        raise DtxFailure(NSError(1, "DTXMessage", f"No channel registered for code {channel}"))

    def _watch_terminations(self, code: int) -> None:
        def on_exit(pid: int, exit_code: int | None, crash_signal: int | None) -> None:
            if pid in self.observed:
                task = asyncio.ensure_future(
                    self.notify(
                        code,
                        "processWithPID:terminatedWithExitCode:orCrashingSignal:",
                        pid,
                        exit_code,
                        crash_signal,
                    )
                )
                self._tasks.add(task)
                task.add_done_callback(self._task_done)

        self._listener = on_exit
        self.device.apps.termination_listeners.add(on_exit)

    # --- services ----------------------------------------------------------------------------------------

    async def process_control(self, selector: str, args: list[Any]) -> Any:
        apps = self.device.apps
        if selector == "launchSuspendedProcessWithDevicePath:bundleIdentifier:environment:arguments:options:":
            _path, bundle_id, environment, arguments, options = (args + [None] * 5)[:5]
            options = options or {}
            faults = self.device.faults
            if faults.launch_errors > 0:
                # A transient failure as a busy phone reports it; the next launch may well succeed.
                faults.launch_errors -= 1
                raise DtxFailure(
                    NSError(
                        TRANSIENT_LAUNCH_ERROR,
                        PROCESS_CONTROL_DOMAIN,
                        f'The request to open "{bundle_id}" failed: the system is busy. Try again.',
                    )
                )
            try:
                pid = await apps.launch(
                    str(bundle_id),
                    arguments=[str(a) for a in arguments or []],
                    environment={str(k): str(v) for k, v in (environment or {}).items()},
                    kill_existing=bool(options.get("KillExisting", True)),
                    start_suspended=bool(options.get("StartSuspendedKey", False)),
                )
            except AppLaunchError as exc:
                raise DtxFailure(NSError(1, PROCESS_CONTROL_DOMAIN, str(exc))) from None
            self.observed.add(pid)
            return pid
        if selector in ("killPid:", "sendSignal:toPid:", "suspendPid:", "resumePid:"):
            if selector == "sendSignal:toPid:":
                sig, pid = int(args[0]), int(args[1])
            else:
                pid = int(args[0])
                sig = {"killPid:": signal.SIGKILL, "suspendPid:": signal.SIGSTOP}.get(selector, signal.SIGCONT)
            try:
                apps.signal(pid, sig)
            except ProcessLookupError:
                raise DtxFailure(NSError(3, PROCESS_CONTROL_DOMAIN, f"No such process: {pid}")) from None
            return None
        if selector == "processIdentifierForBundleIdentifier:":
            return apps.pid_for_bundle(str(args[0]))
        if selector in ("startObservingPid:", "stopObservingPid:"):
            (self.observed.add if selector.startswith("start") else self.observed.discard)(int(args[0]))
            return None
        if selector == "isPidDebuggable:":
            return int(args[0]) in apps.processes
        if selector == "requestDisableMemoryLimitsForPid:":
            process = apps.processes.get(int(args[0]))
            if process is None:
                return False
            process.account.limit_bytes = NO_LIMIT_BYTES
            return True
        raise DtxFailure(NSError(1, "DTXMessage", f"Unrecognized selector {selector}"))

    def device_info(self, selector: str, args: list[Any]) -> Any:
        if selector == "runningProcesses":
            rows: list[dict[str, Any]] = [
                {"pid": 1, "name": "launchd", "realAppName": "/sbin/launchd", "isApplication": False},
                {
                    "pid": 34,
                    "name": "SpringBoard",
                    "realAppName": "/System/Library/CoreServices/SpringBoard.app/SpringBoard",
                    "isApplication": True,
                },
            ]
            for pid, process in self.device.apps.processes.items():
                rows.append(
                    {
                        "pid": pid,
                        "name": process.name,
                        "realAppName": process.name,
                        "isApplication": True,
                        "bundleIdentifier": process.bundle_id,
                    }
                )
            return rows
        if selector == "machTimeInfo":
            return [0, 1, 1, 0]
        raise DtxFailure(NSError(1, "DTXMessage", f"Unrecognized selector {selector}"))


async def serve_instruments(link: Link) -> None:
    await DtxConnection(link).run()
