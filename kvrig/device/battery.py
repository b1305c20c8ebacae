"""Battery and thermal telemetry over lockdown's diagnostics relay (no tunnel): the IORegistry entry
`AppleSmartBattery` gives the battery temperature, level and charging state.

A soak samples it every few seconds: decode speed falls as the phone heats up, and without the temperature
next to tok/s that fall would be misread as the cost of a longer context.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

from pymobiledevice3.services.diagnostics import DiagnosticsService

from kvrig.device.discovery import Device

BATTERY_ENTRY = "AppleSmartBattery"


@dataclass(frozen=True)
class BatterySample:
    t: float  # seconds since the Unix epoch (host clock)
    temperature_c: float | None
    level_percent: float | None
    charging: bool | None
    external_power: bool | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def parse_battery(entry: dict[str, Any], t: float) -> BatterySample:
    """One sample from an AppleSmartBattery IORegistry entry.

    `Temperature` is in hundredths of a degree Celsius. `CurrentCapacity` is a percentage where `MaxCapacity`
    is 100; older phones give both in mAh, so the level is their ratio."""
    temperature = _number(entry.get("Temperature"))
    current, maximum = _number(entry.get("CurrentCapacity")), _number(entry.get("MaxCapacity"))
    level = None
    if current is not None:
        level = current if maximum in (None, 100.0) else (100.0 * current / maximum if maximum else None)
    charging, external = entry.get("IsCharging"), entry.get("ExternalConnected")
    return BatterySample(
        t=t,
        temperature_c=temperature / 100.0 if temperature is not None else None,
        level_percent=round(level, 2) if level is not None else None,
        charging=charging if isinstance(charging, bool) else None,
        external_power=external if isinstance(external, bool) else None,
    )


class BatteryReader:
    """Keeps one diagnostics relay connection for repeated reads: `async with BatteryReader(device) as b`."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._service: DiagnosticsService | None = None

    async def __aenter__(self) -> BatteryReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        service, self._service = self._service, None
        if service is not None:
            with contextlib.suppress(Exception):  # the link may already be gone
                await service.close()

    async def read(self) -> BatterySample:
        async with self.device.errors("reading the battery"):
            if self._service is None:
                self._service = DiagnosticsService(self.device.lockdown)
                await self._service.connect()
            try:
                entry = await self._service.ioregistry(name=BATTERY_ENTRY)
            except BaseException:
                await self.close()  # the next read reconnects
                raise
        return parse_battery(entry or {}, time.time())
