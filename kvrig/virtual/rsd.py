"""RemoteServiceDiscovery: the service directory a phone serves inside its tunnel (iOS 17+).

The host opens TCP to the RSD port and speaks HTTP/2 carrying RemoteXPC messages (pymobiledevice3's own
`XpcWrapper` encoding, reused here). After the HTTP/2 preface and the RemoteXPC stream set-up the host sends a
`Handshake`; the phone answers with its peer info: `Properties` (UDID, ProductType, OSVersion, ...) and
`Services`, each with the TCP `Port` it listens on inside the tunnel. Those services are:

- the remote lockdown services and the `*.shim.remote` shims of lockdown services: the host first sends an
  `RSDCheckin` plist, the phone answers `RSDCheckin` then `StartService`, and the service's usual protocol
  follows (no TLS: the tunnel is already encrypted);
- the instruments hub `com.apple.instruments.dtservicehub`, which speaks DTX straight away, listed only while
  the developer disk image is mounted and Developer Mode is on.

From iOS 27.2 the phone's remoted keeps the `UUID` each handshake presents, and a handshake whose UUID differs
from the one it kept makes it re-attach: it logs "Peer UUID changed across reconnect; reattaching so clients
re-discover it" and closes every service listener it advertised, so each port refuses connections, the
newcomer's included, until a handshake with the kept UUID re-discovers them (pymobiledevice3 reads this rule from
27.2's /usr/libexec/remoted, `remotexpc.default_handshake_uuid`; releases before 11.16 sent a fresh UUID with
every handshake and so lost every service on 27.2, doronz88/pymobiledevice3#1966).
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

from bytestruct import TruncatedDataError
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, PingFrame, SettingsFrame, WindowUpdateFrame
from pymobiledevice3.remote.remotexpc import HTTP2_MAGIC
from pymobiledevice3.remote.xpc_message import (
    XpcMessageType,
    XpcUInt64Type,
    XpcWrapper,
    create_xpc_wrapper,
    decode_xpc_object,
)

from kvrig.virtual.dtx import serve_instruments
from kvrig.virtual.lockdownd import serve_lockdownd
from kvrig.virtual.phone import Handler, Link, Phone
from kvrig.virtual.wire import ProtocolViolation

FRAME_HEADER = 9
MAX_FRAME = 1 << 20
WINDOW = 16 * 1024 * 1024
REMOTE_LOCKDOWN = ("com.apple.mobile.lockdown.remote.trusted", "com.apple.mobile.lockdown.remote.untrusted")
INSTRUMENTS = "com.apple.instruments.dtservicehub"
SHIM = ".shim.remote"
FIRST_SERVICE_PORT = 50000
REATTACH_FROM = (27, 2)  # the first iOS whose remoted re-attaches when the handshake UUID changes
REATTACH_LOG = "Peer UUID changed across reconnect; reattaching so clients re-discover it"


def tunnel_services(device: Phone) -> dict[str, Handler]:
    """What this phone offers inside a tunnel now, by RSD name."""

    services: dict[str, Handler] = {name: checked_in(serve_lockdownd) for name in REMOTE_LOCKDOWN}
    for name, spec in device.services.items():
        if spec.developer or spec.tunnel or device.ios_version < spec.min_ios:
            continue
        if name in device.faults.refuse_services:
            continue
        services[name + SHIM] = checked_in(spec.handler, counts_afc=spec.counts_afc)
    if device.developer_ready():
        services[INSTRUMENTS] = serve_instruments
    return services


def service_port(device: Phone, name: str) -> int:
    """A stable port per service name (a phone keeps them for the life of a tunnel)."""
    return _all_ports(frozenset(device.services))[name]


def service_at(device: Phone, port: int) -> Handler | None:
    if device.rsd_reattached:
        return None  # remoted closed the listeners it advertised: the port refuses the connection
    ports = _all_ports(frozenset(device.services))
    for name, handler in tunnel_services(device).items():
        if ports.get(name) == port:
            return handler
    return None


@functools.cache
def _all_ports(lockdown_services: frozenset[str]) -> dict[str, int]:
    names = sorted({*REMOTE_LOCKDOWN, INSTRUMENTS, *(name + SHIM for name in lockdown_services)})
    return {name: FIRST_SERVICE_PORT + index for index, name in enumerate(names)}


def checked_in(handler: Handler, *, counts_afc: bool = False) -> Handler:
    async def serve(link: Link) -> None:
        link.counts_afc = counts_afc
        request = await link.recv_plist()
        if request.get("Request") != "RSDCheckin":
            raise ProtocolViolation(f"expected RSDCheckin, got {request.get('Request')!r}")
        await link.send_plist({"Request": "RSDCheckin"})
        await link.send_plist({"Request": "StartService"})
        await handler(link)

    return serve


def peer_info(device: Phone) -> dict[str, Any]:
    ident = device.identity
    properties = {
        "AppleInternal": False,
        "BoardId": XpcUInt64Type(0xC),
        "BuildVersion": ident.build_version,
        "ChipID": XpcUInt64Type(ident.chip_id),
        "DeviceClass": "iPhone",
        "DeviceColor": "1",
        "HardwareModel": ident.hardware_model,
        "OSInstallEnvironment": False,
        "OSVersion": ident.product_version,
        "ProductName": "iPhone OS",
        "ProductType": ident.product_type,
        "SensitivePropertiesVisible": True,
        "SerialNumber": ident.serial_number,
        "UniqueChipID": XpcUInt64Type(ident.ecid),
        "UniqueDeviceID": ident.udid,
    }
    services = {
        name: {"Entitlement": "com.apple.mobile.lockdown.remote.trusted", "Port": str(service_port(device, name))}
        for name in tunnel_services(device)
    }
    return {
        "MessageType": "Handshake",
        "MessagingProtocolVersion": XpcUInt64Type(7),
        "Properties": properties,
        "Services": services,
        "UUID": uuid.uuid5(uuid.NAMESPACE_URL, ident.udid),
    }


def _remember_peer(device: Phone, presented: Any) -> None:
    """remoted's re-attach rule (iOS 27.2+): a handshake without a UUID changes nothing; one with the UUID it kept
    re-discovers the services; one with another UUID closes every advertised listener."""
    if device.ios_version < REATTACH_FROM or not isinstance(presented, uuid.UUID):
        return
    if device.rsd_peer_uuid is not None and presented != device.rsd_peer_uuid:
        device.rsd_reattached = True
        device.syslog.emit("remoted", REATTACH_LOG, level="error")
    else:
        device.rsd_reattached = False
    device.rsd_peer_uuid = presented


async def _send_frame(link: Link, frame: Frame) -> None:
    await link.send(frame.serialize())


async def serve_rsd(link: Link) -> None:
    preface = await link.recv_exactly(len(HTTP2_MAGIC))
    if preface != HTTP2_MAGIC:
        raise ProtocolViolation("not an HTTP/2 preface")
    if link.device.faults.rsd_silent:
        while await link.reader.read(65536):  # the host has to give up by itself
            pass
        return
    settings = {SettingsFrame.MAX_CONCURRENT_STREAMS: 100, SettingsFrame.INITIAL_WINDOW_SIZE: WINDOW}
    await _send_frame(link, SettingsFrame(settings=settings))
    await _send_frame(link, WindowUpdateFrame(stream_id=0, window_increment=WINDOW - 65535))
    pending: dict[int, bytes] = {}
    while True:
        frame, size = Frame.parse_frame_header(memoryview(await link.recv_exactly(FRAME_HEADER)))
        if size > MAX_FRAME:
            raise ProtocolViolation(f"HTTP/2 frame of {size} bytes")
        frame.parse_body(memoryview(await link.recv_exactly(size)))
        if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            await _send_frame(link, SettingsFrame(flags=["ACK"]))
        elif isinstance(frame, PingFrame) and "ACK" not in frame.flags:
            await _send_frame(link, PingFrame(flags=["ACK"], opaque_data=frame.opaque_data))
        elif isinstance(frame, GoAwayFrame):
            return
        elif isinstance(frame, DataFrame) and frame.data:
            data = pending.pop(frame.stream_id, b"") + frame.data
            try:
                wrapper = XpcWrapper.parse(data)
            except TruncatedDataError:
                pending[frame.stream_id] = data
                continue
            payload = wrapper.payload
            if payload is None or payload.type != XpcMessageType.DICTIONARY or not payload.data:
                continue
            message = decode_xpc_object(payload)
            if message.get("MessageType") == "Handshake":
                _remember_peer(link.device, message.get("UUID"))
                reply = create_xpc_wrapper(peer_info(link.device), message_id=wrapper.message_id)
                await _send_frame(link, DataFrame(stream_id=frame.stream_id, data=reply))
