"""lockdownd on port 62078: device values, session start with TLS, and StartService.

Requests and replies are length-prefixed plists. A session starts only for the HostID of the pair record,
then the connection switches to TLS with the device certificate. StartService opens a one-shot port that
the client then reaches through usbmuxd `Connect`; errors use lockdownd's own error strings
(InvalidHostID, InvalidService, MissingValue, SessionInactive, ...), which pymobiledevice3 maps to its
exception classes. A malformed phone (faults.py) answers its own device values instead, or device values that
are not a plist dictionary.
"""

from __future__ import annotations

import plistlib
import struct
import time
import uuid
from typing import Any

from kvrig.schemas.keys import VIRTUAL_KEY
from kvrig.virtual.phone import Link, Phone

LOCKDOWN_TYPE = "com.apple.mobile.lockdown"


def device_values(device: Phone) -> dict[str, Any]:
    """The root domain of GetValue, as a paired host sees it (with the values a malformed-phone fault sets)."""
    ident = device.identity
    return {
        "ActivationState": "Activated",
        "BasebandVersion": "2.00.05",
        "BluetoothAddress": ident.wifi_mac,
        "BuildVersion": ident.build_version,
        "CPUArchitecture": "arm64e",
        "ChipID": ident.chip_id,
        "DeviceClass": "iPhone",
        "DeviceColor": "1",
        "DeviceName": ident.device_name,
        "DevicePublicKey": device.pairing.device_public_key,
        "HardwareModel": ident.hardware_model,
        "HardwarePlatform": f"t{ident.chip_id:x}",
        "HostAttached": True,
        # not an Apple key: how kvrig tells its virtual iPhone (the app runs on the host's CPU) from a phone
        VIRTUAL_KEY: True,
        "MarketingName": ident.marketing_name,
        "PasswordProtected": False,
        "ProductName": "iPhone OS",
        "ProductType": ident.product_type,
        "ProductVersion": ident.product_version,
        "ProtocolVersion": "2",
        "SerialNumber": ident.serial_number,
        "TimeIntervalSince1970": time.time(),
        "TimeZone": "UTC",
        "TimeZoneOffsetFromUTC": 0.0,
        "Uses24HourClock": True,
        "TrustedHostAttached": True,
        "UniqueChipID": ident.ecid,
        "UniqueDeviceID": ident.udid,
        "WiFiAddress": ident.wifi_mac,
    } | device.faults.lockdown_values


def garbage_values(device: Phone, reply: dict[str, Any]) -> bytes | None:
    """The framed reply a malformed phone sends for all its values: cut off mid-plist, or a plist array."""
    kind = device.faults.lockdown_garbage
    if kind is None:
        return None
    payload = plistlib.dumps([reply] if kind == "array" else reply)
    if kind == "truncated":
        payload = payload[: len(payload) // 2]
    return struct.pack(">I", len(payload)) + payload


def domain_values(device: Phone, domain: str) -> dict[str, Any] | None:
    if domain == "com.apple.disk_usage":
        return {"TotalDiskCapacity": 128_000_000_000, "AmountDataAvailable": 64_000_000_000}
    if domain == "com.apple.mobile.battery":
        device.battery.sample(device.apps.processes)
        return {
            "BatteryCurrentCapacity": int(device.battery.level),
            "BatteryIsCharging": device.battery.charging,
            "ExternalChargeCapable": device.battery.external_connected,
            "ExternalConnected": device.battery.external_connected,
            "FullyCharged": device.battery.level >= 100,
            "HasBattery": True,
        }
    if domain == "com.apple.security.mac.amfi" and device.ios_major >= 16:
        return {"DeveloperModeStatus": device.state.developer().developer_mode}
    if domain == "com.apple.PurpleBuddy":
        return {"SetupDone": True}
    if domain == "com.apple.mobile.iTunes":
        return {"MinimumiTunesVersion": "12.8"}
    return None


async def serve_lockdownd(link: Link) -> None:
    device = link.device
    session_id: str | None = None
    while True:
        request = await link.recv_plist()
        name = str(request.get("Request", ""))
        reply: dict[str, Any] = {"Request": name}
        if name == "QueryType":
            reply["Type"] = LOCKDOWN_TYPE
        elif name == "GetValue":
            domain, key = request.get("Domain"), request.get("Key")
            values = device_values(device) if domain is None else domain_values(device, str(domain))
            if values is None:
                reply["Error"] = "MissingValue"
            elif key is None:
                reply["Value"] = values
            elif key in values:
                reply["Key"] = key
                reply["Value"] = values[key]
            else:
                reply["Error"] = "MissingValue"
            if domain is not None:
                reply["Domain"] = domain
            elif key is None and (garbage := garbage_values(device, reply)) is not None:
                await link.send(garbage)
                continue
        elif name in ("SetValue", "RemoveValue"):
            reply["Error"] = "SetProhibited" if name == "SetValue" else "RemoveProhibited"
        elif name == "Pair" and device.faults.untrusted:
            reply["Error"] = "PairingDialogResponsePending"  # the Trust dialog shows until someone answers it
        elif name == "ValidatePair" or name == "Pair":
            record = request.get("PairRecord") or {}
            if record.get("HostID") != device.pairing.host_id:
                reply["Error"] = "PairingProhibitedOverThisConnection"
            elif name == "Pair":
                reply["EscrowBag"] = device.pairing.escrow_bag
        elif name == "StartSession":
            if request.get("HostID") != device.pairing.host_id or device.faults.untrusted:
                reply["Error"] = "InvalidHostID"
            elif session_id is not None:
                reply["Error"] = "SessionActive"
            else:
                session_id = str(uuid.uuid4()).upper()
                reply.update({"SessionID": session_id, "EnableSessionSSL": True})
                await link.send_plist(reply)
                await link.start_tls()
                continue
        elif name == "StopSession":
            if session_id is None or request.get("SessionID") != session_id:
                reply["Error"] = "SessionInactive"
            else:
                session_id = None
                reply["Result"] = "Success"
        elif name == "StartService":
            service = str(request.get("Service", ""))
            if session_id is None:
                reply["Error"] = "SessionInactive"
            elif service == device.faults.unplug_on_service:
                await device.unplug()
                return
            else:
                opened = device.open_service(service)
                reply["Service"] = service
                if isinstance(opened, str):
                    reply["Error"] = opened
                else:
                    port, ssl = opened
                    reply["Port"] = port
                    if ssl:
                        reply["EnableServiceSSL"] = True
        elif name == "Goodbye":
            reply["Result"] = "Success"
            await link.send_plist(reply)
            return
        else:
            reply["Error"] = "InvalidRequest"
        await link.send_plist(reply)
