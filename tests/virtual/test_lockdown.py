"""usbmuxd + lockdownd, driven by pymobiledevice3's own library: device list, pair record, TLS session,
values, concurrent clients, and the errors a phone gives to bad input."""

from __future__ import annotations

import asyncio
import plistlib
import socket
import struct

import pytest
from pymobiledevice3 import usbmux
from pymobiledevice3.exceptions import InvalidServiceError
from pymobiledevice3.lockdown import create_using_usbmux

from tests.virtual.conftest import Emulator


def test_usbmux_lists_both_devices_as_usb(emulator: Emulator) -> None:
    devices = asyncio.run(usbmux.list_devices())
    serials = {d.serial for d in devices}
    assert serials == {emulator.udid, emulator.ios17.identity.udid}
    assert all(d.is_usb for d in devices)


def test_lockdown_session_is_paired_over_tls(emulator: Emulator) -> None:
    async def main() -> tuple[bool, object, str, str]:
        lockdown = await create_using_usbmux(serial=emulator.udid)
        try:
            ssl_object = lockdown.service.writer.get_extra_info("ssl_object")
            return (
                lockdown.paired,
                ssl_object,
                lockdown.product_type,
                await lockdown.get_value(key="ProductVersion"),
            )
        finally:
            await lockdown.close()

    paired, ssl_object, product_type, version = asyncio.run(main())
    assert paired
    assert ssl_object is not None and ssl_object.version() in ("TLSv1.2", "TLSv1.3")
    assert product_type == "iPhone16,1"
    assert version == "16.7"


def test_pair_record_comes_from_usbmuxd_and_matches_device_certificate(emulator: Emulator) -> None:
    from cryptography import x509

    async def main() -> dict:
        mux = await usbmux.create_mux()
        try:
            assert isinstance(mux, usbmux.PlistMuxConnection)
            return await mux.get_pair_record(emulator.udid)
        finally:
            await mux.close()

    record = asyncio.run(main())
    root = x509.load_pem_x509_certificate(record["RootCertificate"])
    host = x509.load_pem_x509_certificate(record["HostCertificate"])
    device = x509.load_pem_x509_certificate(record["DeviceCertificate"])
    host.verify_directly_issued_by(root)
    device.verify_directly_issued_by(root)
    # The certificate lockdownd presents in TLS is the pair record's device certificate.
    pem = emulator.device.pairing.device_cert
    assert x509.load_pem_x509_certificate(pem) == device


def test_concurrent_lockdown_clients(emulator: Emulator) -> None:
    async def one() -> str:
        lockdown = await create_using_usbmux(serial=emulator.udid)
        try:
            return await lockdown.get_value(key="UniqueDeviceID")
        finally:
            await lockdown.close()

    async def main() -> list[str]:
        return await asyncio.gather(*(one() for _ in range(6)))

    assert asyncio.run(main()) == [emulator.udid] * 6


def test_unknown_service_is_refused_like_a_phone(emulator: Emulator) -> None:
    async def main() -> None:
        lockdown = await create_using_usbmux(serial=emulator.udid)
        try:
            await lockdown.start_lockdown_service("com.example.no.such.service")
        finally:
            await lockdown.close()

    with pytest.raises(InvalidServiceError):
        asyncio.run(main())


def test_installation_proxy_replies_in_binary_plist(emulator: Emulator) -> None:
    async def main() -> bytes:
        lockdown = await create_using_usbmux(serial=emulator.udid)
        try:
            service = await lockdown.start_lockdown_service("com.apple.mobile.installation_proxy")
            await service.send_plist({"Command": "Lookup", "ClientOptions": {"ApplicationType": "System"}})
            raw = await service.recv_prefixed()
            await service.close()
            return raw
        finally:
            await lockdown.close()

    raw = asyncio.run(main())
    assert raw.startswith(b"bplist00")
    assert "com.apple.mobilesafari" in plistlib.loads(raw)["LookupResult"]


def _mux_packet(payload: dict) -> bytes:
    body = plistlib.dumps(payload)
    return struct.pack("<IIII", 16 + len(body), 1, 8, 1) + body


def _mux_connect(raw: socket.socket, emulator: Emulator, port: int) -> int:
    """A usbmuxd Connect to the phone's `port` written by hand on `raw`; the result number usbmuxd answers."""
    raw.settimeout(5)
    raw.connect(emulator.address)
    packet = {"MessageType": "Connect", "DeviceID": emulator.device.device_id, "PortNumber": socket.htons(port)}
    raw.sendall(_mux_packet(packet))
    header = raw.recv(16)
    length = struct.unpack("<I", header[:4])[0]
    return plistlib.loads(raw.recv(length - 16))["Number"]


def test_garbage_on_the_socket_drops_only_that_client(emulator: Emulator) -> None:
    garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    garbage.settimeout(5)
    garbage.connect(emulator.address)
    garbage.sendall(b"\xff" * 64)
    assert garbage.recv(100) == b""  # usbmuxd hung up on it
    garbage.close()
    # a lockdown connection that receives non-plist bytes is dropped too
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    assert _mux_connect(raw, emulator, 62078) == 0
    raw.sendall(struct.pack(">I", 12) + b"not a plist!")
    assert raw.recv(100) == b""
    raw.close()
    # meanwhile every other client is still served
    assert {d.serial for d in asyncio.run(usbmux.list_devices())} >= {emulator.udid}
    test_concurrent_lockdown_clients(emulator)


def test_connect_to_a_closed_port_is_refused(emulator: Emulator) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        assert _mux_connect(raw, emulator, 50999) == 3  # CONNREFUSED
