"""com.apple.mobile.diagnostics_relay: IORegistry queries (the battery's `AppleSmartBattery` entry, also found
by its superclass `IOPMPowerSource`), the `GasGauge`/`All` diagnostics, MobileGestalt (deprecated from
iOS 17, as on a phone), and Restart/Shutdown/Sleep. Requests are `{"Request": ...}` plists; replies carry
`Status` (`Success`, `Failure`, `UnknownRequest`) and a `Diagnostics` dictionary."""

from __future__ import annotations

from typing import Any

from kvrig.virtual.phone import Link

BATTERY_CLASSES = {"AppleSmartBattery", "IOPMPowerSource"}


def ioregistry(battery_entry: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    # libimobiledevice sends an empty string for the criterion it does not use
    name, klass = request.get("EntryName") or None, request.get("EntryClass") or None
    if name is None and klass is None:
        return {"IORegistryEntryName": "Root", "IOObjectClass": "IORegistryEntry"}
    if (name is None or name == "AppleSmartBattery") and (klass is None or klass in BATTERY_CLASSES):
        return battery_entry
    return {}


def gas_gauge(battery_entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "CycleCount": battery_entry["CycleCount"],
        "DesignCapacity": battery_entry["DesignCapacity"],
        "FullChargeCapacity": battery_entry["AppleRawMaxCapacity"],
        "Status": "Success",
    }


async def serve_diagnostics_relay(link: Link) -> None:
    device = link.device
    while True:
        request = await link.recv_plist()
        kind = request.get("Request")
        device.battery.sample(device.apps.processes)
        entry = device.battery.ioregistry()
        reply: dict[str, Any] = {"Status": "Success"}
        if kind == "IORegistry":
            reply["Diagnostics"] = {"IORegistry": ioregistry(entry, request)}
        elif kind in ("All", "GasGauge"):
            diagnostics = {"GasGauge": gas_gauge(entry)}
            if kind == "All":
                diagnostics.update({"WiFi": {"Active": True, "Status": "Success"}, "NAND": {"Status": "Success"}})
            reply["Diagnostics"] = diagnostics
        elif kind == "MobileGestalt":
            if device.ios_major >= 17:
                reply["Diagnostics"] = {"MobileGestalt": {"Status": "MobileGestaltDeprecated"}}
            else:
                keys = request.get("MobileGestaltKeys") or []
                known = {"ProductType": device.identity.product_type, "UniqueChipID": device.identity.ecid}
                values = {k: known[k] for k in keys if k in known}
                reply["Diagnostics"] = {"MobileGestalt": {**values, "Status": "Success"}}
        elif kind in ("Goodbye", "Restart", "Shutdown", "Sleep"):
            await link.send_plist(reply)
            if kind == "Restart":
                device.schedule_reboot()
            elif kind == "Shutdown":
                device.schedule_reboot(come_back=False)
            return
        else:
            reply = {"Status": "UnknownRequest"}
        await link.send_plist(reply)
