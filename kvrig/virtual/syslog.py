"""The device log: a bus every part of the emulator writes to (kernel, lockdownd, running apps), and the two
services that stream it: `com.apple.syslog_relay` (text lines ending in "\\n\\0") and
`com.apple.os_trace_relay` (binary activity-stream records, what `pymobiledevice3 syslog live` reads)."""

from __future__ import annotations

import struct
import time
import uuid

from pymobiledevice3.services.os_trace import SyslogLogLevel

from kvrig.compat.os_trace import SyslogRecordHeader
from kvrig.virtual.logbus import SYSTEM_PIDS, LogLine
from kvrig.virtual.phone import Link
from kvrig.virtual.wire import encode_plist

LEVELS = {level.name.lower(): level for level in SyslogLogLevel}


def format_text(line: LogLine, device_name: str) -> bytes:
    stamp = time.strftime("%b %d %H:%M:%S", time.localtime(line.t))
    level = line.level.capitalize()
    return f"{stamp} {device_name} {line.process}[{line.pid}] <{level}>: {line.message}\n\x00".encode()


def format_record(line: LogLine) -> bytes:
    seconds = int(line.t)
    image = f"/usr/lib/{line.process}".encode() + b"\0"
    message = line.message.encode() + b"\0"
    subsystem = line.subsystem.encode() + b"\0" if line.subsystem else b""
    category = (line.category or "default").encode() + b"\0" if line.subsystem else b""
    header = SyslogRecordHeader(
        _unknown0=b"\0" * 9,
        pid=line.pid,
        procid=line.pid,
        process_image_uuid=uuid.uuid5(uuid.NAMESPACE_DNS, line.process),
        _unknown1=b"\0" * 18,
        seconds=seconds,
        _unknown2=0,
        microseconds=int((line.t - seconds) * 1_000_000),
        _unknown3=0,
        level=LEVELS.get(line.level, SyslogLogLevel.NOTICE),
        _unknown4=b"\0" * 6,
        mach_timestamp=int(line.t * 24_000_000),
        thread_id=line.pid * 1000 + 1,
        image_uuid=uuid.uuid5(uuid.NAMESPACE_URL, line.process),
        image_name_size=len(image),
        message_size=len(message),
        _unknown5=0,
        sender_image_offset=0,
        subsystem_size=len(subsystem),
        category_size=len(category),
        _unknown6=0,
    ).build()
    filename = f"/usr/libexec/{line.process}".encode() + b"\0"
    return header + filename + image + message + subsystem + category


async def serve_syslog_relay(link: Link) -> None:
    bus = link.device.syslog
    queue = bus.subscribe()
    try:
        while True:
            line = await bus.follow(queue)
            await link.send(format_text(line, link.device.identity.device_name))
    finally:
        bus.unsubscribe(queue)


async def serve_os_trace_relay(link: Link) -> None:
    request = await link.recv_plist()
    bus = link.device.syslog
    if request.get("Request") == "PidList":
        pids = {str(pid): {"ProcessName": name} for name, pid in SYSTEM_PIDS.items()}
        for pid, name in link.device.apps.running().items():
            pids[str(pid)] = {"ProcessName": name}
        await link.send(b"\x01" + encode_plist({"Status": "RequestSuccessful", "Payload": pids}))
        return
    if request.get("Request") != "StartActivity":
        await link.send(b"\x01" + encode_plist({"Status": "RequestFailed"}))
        return
    only_pid = int(request.get("Pid", -1))
    status = encode_plist({"Status": "RequestSuccessful"})[4:]
    await link.send(struct.pack("<I", 4) + struct.pack("<I", len(status)) + status)
    queue = bus.subscribe()
    try:
        while True:
            line = await bus.follow(queue)
            if only_pid != -1 and line.pid != only_pid:
                continue
            record = format_record(line)
            await link.send(b"\x02" + struct.pack("<I", len(record)) + record)
    finally:
        bus.unsubscribe(queue)
