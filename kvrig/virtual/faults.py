"""Faults a test or a user injects into a virtual device, by option at start or through the API at run time.

- unplug after N bytes of AFC traffic (the device disappears from usbmuxd mid-transfer; `replug()` returns it),
  or when a client asks lockdownd to start a named service (the cable goes between two steps of a client)
- refuse a service (lockdownd answers StartService with InvalidService, as a phone without the service does)
- crash the app when its context reaches N tokens (the process dies of SIGSEGV)
- stall the app at N tokens (the process is stopped: it hangs, alive, and answers nothing)
- every other way an app ends, each with the evidence a real phone leaves (log lines in its format, a report or
  none): jetsam without a JetsamEvent report (the kernel's lines only, as for an app killed while suspended),
  a GPU-from-background abort at N tokens (Metal's "Insufficient Permission" line, SIGABRT, a crash report), a
  watchdog kill at N tokens (FrontBoard's 0x8badf00d termination line and its crash report), and an app that
  vanishes at N tokens (SIGKILL, nothing logged, nothing filed)
- slow link (every service connection is paced to N bytes per second)
- Developer Mode off / developer disk image missing (device state: AMFI and the image mounter restore it)
- tunnel drop after N bytes through the CoreDeviceProxy tunnel (the phone stays plugged; while the fault stays
  set every new tunnel drops too, a tunnel that does not come back; clear it and the next tunnel works)
- handshake timeout (CoreDeviceProxy accepts the connection but never answers the CDTunnel handshake)
- transient launch errors (the next N launches fail with an NSError of com.apple.dt.deviceprocesscontrolservice)
- a phone that lies (every AFC root: crash store, app containers, media; files matched by name, `fnmatch`):
  a size it claims for a file (`stat` answers it, the content stays what it is), reads that never reach the end
  (every READ returns a full chunk of `x` lines), reads that stall (each READ waits N seconds before its reply),
  directory entries that are listed but not there (a report rotated away between listing and pulling)
- a phone that does not trust this computer (usbmuxd holds no pair record for it, lockdownd refuses a session
  with InvalidHostID as after the user reset Location & Privacy, and answers Pair with the Trust dialog pending)
- lockdownd values of the wrong type or size (a ProductType that is a number, a ProductVersion of 5000 digits)
  and device values that are not a plist dictionary (cut off mid-plist, or a plist array)
"""

from __future__ import annotations

import fnmatch
import posixpath
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

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
    rsd_silent: bool = False  # RSD, inside the tunnel, takes the connection and never sends its HTTP/2 settings
    launch_errors: int = 0
    claim_sizes: dict[str, int] = field(default_factory=dict)  # file-name pattern -> the st_size stat answers
    endless_reads: list[str] = field(default_factory=list)  # file-name patterns whose reads never reach the end
    slow_reads: dict[str, float] = field(default_factory=dict)  # file-name pattern -> seconds each READ waits
    phantom_entries: list[str] = field(default_factory=list)  # names every directory listing shows, not there
    lockdown_values: dict[str, Any] = field(default_factory=dict)  # device values lockdownd answers instead
    lockdown_garbage: Literal["truncated", "array"] | None = None  # the device values as a broken plist
    jetsam_without_report: bool = False  # a jetsam kill files no JetsamEvent report; the log still says it
    gpu_background_at_tokens: int | None = None
    watchdog_at_tokens: int | None = None
    vanish_at_tokens: int | None = None
    unplug_on_service: str | None = None  # lockdownd's StartService for this service pulls the cable instead
    untrusted: bool = False  # no pair record, no session: the phone does not trust this computer

    def claimed_size(self, device_path: str) -> int | None:
        return next((size for pattern, size in self.claim_sizes.items() if _named(device_path, pattern)), None)

    def endless(self, device_path: str) -> bool:
        return any(_named(device_path, pattern) for pattern in self.endless_reads)

    def read_delay_s(self, device_path: str) -> float:
        return max((s for pattern, s in self.slow_reads.items() if _named(device_path, pattern)), default=0.0)

    def check(self, ios: str) -> None:
        """Refuses faults a phone of this iOS version cannot have."""

        version = tuple(int(part) for part in ios.split(".")[:2])
        tunnel_faults = self.tunnel_drop_after_bytes is not None or self.handshake_timeout or self.rsd_silent
        if tunnel_faults and version < (17, 4):
            raise VirtualFaultError(
                f"iOS {ios} has no CoreDeviceProxy tunnel to fault",
                field="faults",
                expected="--ios 17.4 or later for tunnel faults",
            )
        if self.developer_mode_off and version < (16, 0):
            raise VirtualFaultError(f"iOS {ios} has no Developer Mode", field="faults", expected="--ios 16.0 or later")

    def to_json(self) -> dict[str, Any]:
        """Only the faults that are set (plists have no null)."""
        data = {k: v for k, v in asdict(self).items() if v is not None and v is not False and v != {} and v != []}
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


def _named(device_path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(posixpath.basename(device_path), pattern)
