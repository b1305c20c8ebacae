"""Faults a test or a user injects into a virtual device, by option at start or through the API at run time.

- unplug after N bytes of AFC traffic (the device disappears from usbmuxd mid-transfer; `replug()` returns it)
- refuse a service (lockdownd answers StartService with InvalidService, as a phone without the service does)
- crash the app when its context reaches N tokens (the process dies of SIGSEGV)
- stall the app at N tokens (the process is stopped: it hangs, alive, and answers nothing)
- slow link (every service connection is paced to N bytes per second)
- Developer Mode off / developer disk image missing (device state: AMFI and the image mounter restore it)
- tunnel drop after N bytes through the CoreDeviceProxy tunnel (the phone stays plugged; while the fault stays
  set every new tunnel drops too, a tunnel that does not come back; clear it and the next tunnel works)
- handshake timeout (CoreDeviceProxy accepts the connection but never answers the CDTunnel handshake)
- transient launch errors (the next N launches fail with an NSError of com.apple.dt.deviceprocesscontrolservice)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvrig.exceptions import VirtualFaultError


@dataclass
class FaultPlan:
    unplug_after_afc_bytes: int | None = None
    refuse_services: set[str] = field(default_factory=set)
    crash_at_tokens: int | None = None
    hang_at_tokens: int | None = None
    slow_link_bytes_per_s: float | None = None
    developer_mode_off: bool = False
    image_missing: bool = False
    tunnel_drop_after_bytes: int | None = None
    handshake_timeout: bool = False
    launch_errors: int = 0

    def check(self, ios: str) -> None:
        """Refuses faults a phone of this iOS version cannot have."""

        version = tuple(int(part) for part in ios.split(".")[:2])
        if (self.tunnel_drop_after_bytes is not None or self.handshake_timeout) and version < (17, 4):
            raise VirtualFaultError(
                f"iOS {ios} has no CoreDeviceProxy tunnel to fault",
                field="faults",
                expected="--ios 17.4 or later for tunnel faults",
            )
        if self.developer_mode_off and version < (16, 0):
            raise VirtualFaultError(f"iOS {ios} has no Developer Mode", field="faults", expected="--ios 16.0 or later")

    def to_json(self) -> dict[str, Any]:
        """Only the faults that are set (plists have no null)."""
        data = {k: v for k, v in asdict(self).items() if v is not None and v is not False}
        if not self.launch_errors:
            data.pop("launch_errors")
        data["refuse_services"] = sorted(self.refuse_services)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FaultPlan:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if "refuse_services" in known:
            known["refuse_services"] = set(known["refuse_services"])
        return cls(**known)
