"""The battery of a virtual phone: level, charging, temperature, driven by what its apps actually compute.

Heat follows the CPU time the app processes consumed (read from the host kernel): the battery warms toward a
temperature that rises with that load and cools back toward its idle temperature, with a thermal time
constant of a minute, as a phone does under a sustained decode loop. The level charges from the USB port and
drains with load. Nothing here is scripted: an idle phone stays cool, a busy one warms up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvrig.virtual.footprint import cpu_seconds

AMBIENT_C = 24.0
IDLE_RISE_C = 4.0  # a plugged-in idle phone sits a few degrees above the room
LOAD_RISE_C = 14.0  # per fully busy core, at equilibrium
THERMAL_TAU_S = 60.0
CHARGE_PCT_PER_S = 1.0 / 90  # USB charging, about 0.7 %/min
DRAIN_PCT_PER_S = 1.0 / 40  # per fully busy core
DESIGN_CAPACITY_MAH = 3274
NOMINAL_VOLTAGE_MV = 3870


@dataclass
class Battery:
    level: float = 87.0
    temperature_c: float = AMBIENT_C + IDLE_RISE_C
    external_connected: bool = True
    updated: float = field(default_factory=time.monotonic)
    _cpu: dict[int, float] = field(default_factory=dict)
    load: float = 0.0

    def sample(self, pids: Iterable[int]) -> None:
        """Advances the model to now with the CPU time the processes `pids` (the phone's apps) used since the
        last sample."""
        now = time.monotonic()
        dt = now - self.updated
        busy = 0.0
        seen: dict[int, float] = {}
        for pid in pids:
            used = cpu_seconds(pid)
            seen[pid] = used
            busy += max(0.0, used - self._cpu.get(pid, 0.0))  # a new process: all its CPU time is new
        self._cpu = seen
        if dt <= 0:
            return
        self.updated = now
        self.load = busy / dt
        target = AMBIENT_C + IDLE_RISE_C + LOAD_RISE_C * self.load
        self.temperature_c += (target - self.temperature_c) * (1 - math.exp(-dt / THERMAL_TAU_S))
        rate = (CHARGE_PCT_PER_S if self.charging else 0.0) - DRAIN_PCT_PER_S * self.load
        self.level = min(100.0, max(1.0, self.level + rate * dt))

    @property
    def charging(self) -> bool:
        return self.external_connected and self.level < 100.0

    def ioregistry(self) -> dict[str, Any]:
        """The AppleSmartBattery IORegistry entry, with the keys and units iOS reports."""
        raw_capacity = int(DESIGN_CAPACITY_MAH * 0.96 * self.level / 100)
        amperage = (600 if self.charging else 0) - int(450 * self.load)
        return {
            "IORegistryEntryName": "AppleSmartBattery",
            "IOObjectClass": "AppleSmartBattery",
            "Temperature": round(self.temperature_c * 100),
            "VirtualTemperature": round(self.temperature_c * 100),
            "CurrentCapacity": int(self.level),
            "MaxCapacity": 100,
            "AppleRawCurrentCapacity": raw_capacity,
            "AppleRawMaxCapacity": int(DESIGN_CAPACITY_MAH * 0.96),
            "NominalChargeCapacity": int(DESIGN_CAPACITY_MAH * 0.96),
            "DesignCapacity": DESIGN_CAPACITY_MAH,
            "CycleCount": 212,
            "IsCharging": self.charging,
            "FullyCharged": self.level >= 100.0,
            "ExternalConnected": self.external_connected,
            "ExternalChargeCapable": self.external_connected,
            "AtCriticalLevel": self.level < 5,
            "BatteryInstalled": True,
            "Voltage": NOMINAL_VOLTAGE_MV + int(4 * (self.level - 50)),
            "InstantAmperage": amperage,
            "Amperage": amperage,
            "UpdateTime": int(time.time()),
        }
