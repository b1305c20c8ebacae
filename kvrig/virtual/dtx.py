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
from collections.abc import Callable
from typing import Any

from bpylist2 import archiver
from bytestruct import BinaryParseError
from pymobiledevice3.dtx.message_aux import MessageAux
from pymobiledevice3.dtx.ns_types import NSError, register_ns_keyed_classes
from pymobiledevice3.dtx.structs import (
    FRAGMENT_HEADER_MIN_SIZE,
    FRAGMENT_PAYLOAD_HEADER_SIZE,
    DtxFragmentHeader,
    DtxFragmentPayloadHeader,
    DTXMessageType,
    DTXTransportFlags,
)
from pymobiledevice3.services.dvt.instruments.device_info import DeviceInfoService
from pymobiledevice3.services.dvt.instruments.process_control import ProcessControlService

from kvrig.virtual.apprun import AppLaunchError
from kvrig.virtual.phone import Link
from kvrig.virtual.wire import ProtocolViolation

log = logging.getLogger(__name__)

# The fragment and payload headers, message types, primitive dictionaries and NSError are pymobiledevice3's (the
# client these serve), so an upstream change to the wire format shows on both sides.
register_ns_keyed_classes()
MAX_MESSAGE = 32 * 1024 * 1024

PROCESS_CONTROL = ProcessControlService.IDENTIFIER
DEVICE_INFO = DeviceInfoService.IDENTIFIER
PROCESS_CONTROL_DOMAIN = "com.apple.dt.deviceprocesscontrolservice"
TRANSIENT_LAUNCH_ERROR = 1  # the code of the transient launch failure the launch-error fault injects
# Limit a process gets after requestDisableMemoryLimitsForPid: (the per-process limit is waived).
NO_LIMIT_BYTES = 1 << 40


class DtxFailure(Exception):
    """A request the service refuses: answered with an ERROR carrying an NSError in the phone's words."""

    def __init__(self, code: int, domain: str, description: str) -> None:
        super().__init__(description)
        self.error = NSError(code, domain, {"NSLocalizedDescription": description})


def decode_aux(data: bytes) -> list[Any]:
    """The positional arguments of a DISPATCH: a primitive dictionary of NULL keys."""
    try:
        return MessageAux.parse(data)
    except BinaryParseError as exc:
        raise ProtocolViolation(f"malformed aux: {exc}") from exc


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
        self,
        msg_type: DTXMessageType,
        channel: int,
        identifier: int,
        conversation: int,
        *,
        payload: Any = None,
        aux: tuple[Any, ...] = (),
    ) -> None:
        payload_bytes = archiver.archive(payload) if payload is not None else b""
        aux_bytes = MessageAux.build(list(aux))
        body = (
            DtxFragmentPayloadHeader(
                msg_type=msg_type,
                flags_a=0,
                flags_b=0,
                reserved=0,
                aux_size=len(aux_bytes),
                total_size=len(aux_bytes) + len(payload_bytes),
                flags=0,
            ).build()
            + aux_bytes
            + payload_bytes
        )
        header = DtxFragmentHeader(
            header_size=FRAGMENT_HEADER_MIN_SIZE,
            index=0,
            count=1,
            data_size=len(body),
            identifier=identifier,
            conversation_index=conversation,
            channel_code=channel,
            flags=DTXTransportFlags.NONE,
        )
        async with self._send_lock:
            await self.link.send(header.build() + body)

    async def notify(self, channel: int, selector: str, *args: Any) -> None:
        identifier = self._next_id
        self._next_id += 1
        wire_channel = -channel if channel else 0
        await self.send(DTXMessageType.DISPATCH, wire_channel, identifier, 0, payload=selector, aux=args)

    async def read_message(self) -> tuple[int, int, int, int, int, bytes, bytes]:
        """Next whole message: (type, identifier, conversation, channel, flags, aux, payload)."""
        while True:
            raw = await self.link.recv_exactly(FRAGMENT_HEADER_MIN_SIZE)
            try:
                fragment = DtxFragmentHeader.parse(raw)
            except BinaryParseError as exc:  # the magic is declared constant in the header record
                raise ProtocolViolation(f"bad DTX fragment header {raw.hex()}") from exc
            header_size, size, identifier = fragment.header_size, fragment.data_size, fragment.identifier
            if header_size < FRAGMENT_HEADER_MIN_SIZE or size > MAX_MESSAGE:
                raise ProtocolViolation(f"bad DTX fragment header {raw.hex()}")
            if header_size > FRAGMENT_HEADER_MIN_SIZE:
                await self.link.recv_exactly(header_size - FRAGMENT_HEADER_MIN_SIZE)
            if fragment.count > 1 and fragment.index == 0:
                self._partial[identifier] = bytearray()
                continue
            chunk = await self.link.recv_exactly(size)
            if fragment.count > 1:
                buffer = self._partial.setdefault(identifier, bytearray())
                buffer += chunk
                if fragment.index + 1 < fragment.count:
                    continue
                chunk = bytes(self._partial.pop(identifier))
            if len(chunk) < FRAGMENT_PAYLOAD_HEADER_SIZE:
                raise ProtocolViolation("DTX message shorter than its payload header")
            body = DtxFragmentPayloadHeader.parse(chunk)
            aux_size, total = body.aux_size, body.total_size
            if FRAGMENT_PAYLOAD_HEADER_SIZE + total != len(chunk) or aux_size > total:
                raise ProtocolViolation("DTX payload sizes do not add up")
            aux = chunk[FRAGMENT_PAYLOAD_HEADER_SIZE : FRAGMENT_PAYLOAD_HEADER_SIZE + aux_size]
            payload = chunk[FRAGMENT_PAYLOAD_HEADER_SIZE + aux_size :]
            return (
                body.msg_type,
                identifier,
                fragment.conversation_index,
                fragment.channel_code,
                fragment.flags,
                aux,
                payload,
            )

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
                if msg_type != DTXMessageType.DISPATCH or conversation % 2 == 1:
                    continue  # replies to our notifications, and data we do not consume
                wants_reply = bool(flags & DTXTransportFlags.EXPECTS_REPLY)
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
                        await self.send(
                            DTXMessageType.ERROR, channel, identifier, conversation + 1, payload=failure.error
                        )
                    continue
                if wants_reply:
                    if result is None:
                        await self.send(DTXMessageType.OK, channel, identifier, conversation + 1)
                    else:
                        await self.send(DTXMessageType.OBJECT, channel, identifier, conversation + 1, payload=result)
        finally:
            if self._listener is not None:
                self.device.apps.termination_listeners.discard(self._listener)

    async def dispatch(self, channel: int, selector: str, args: list[Any]) -> Any:
        if channel == 0:
            if selector == "_requestChannelWithCode:identifier:":
                code, identifier = int(args[0]), str(args[1])
                if identifier not in (PROCESS_CONTROL, DEVICE_INFO):
                    raise DtxFailure(1, "DTXMessage", f"Unable to find service for {identifier}")
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
        raise DtxFailure(1, "DTXMessage", f"No channel registered for code {channel}")

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
                    TRANSIENT_LAUNCH_ERROR,
                    PROCESS_CONTROL_DOMAIN,
                    f'The request to open "{bundle_id}" failed: the system is busy. Try again.',
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
                raise DtxFailure(1, PROCESS_CONTROL_DOMAIN, str(exc)) from None
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
                raise DtxFailure(3, PROCESS_CONTROL_DOMAIN, f"No such process: {pid}") from None
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
        raise DtxFailure(1, "DTXMessage", f"Unrecognized selector {selector}")

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
        raise DtxFailure(1, "DTXMessage", f"Unrecognized selector {selector}")


async def serve_instruments(link: Link) -> None:
    await DtxConnection(link).run()
