"""What the numbers and words in a JetsamEvent report mean: priority bands and kill reasons.

Priority bands are the kernel's JETSAM_PRIORITY_* values, copied from xnu `bsd/sys/kern_memorystatus.h`:
- before iOS 16: github.com/apple/darwin-xnu @ 0a798f6738bc1db01281fc08ae024145e84df927 (xnu-4570 .. 7195:
  idle 0, aging 1-2, background 3, mail 4, phone 5, UI support 8, foreground support 9, foreground 10, ...,
  critical 19, max 21);
- iOS 16 and later: github.com/apple-oss-distributions/xnu @ 699cd48037512bf4380799317ca44ca453c82f57 (the
  same bands times ten, plus entitled experiment bands 1-9, freezer 75 and driver-apple 150, max 210).
Real reports agree: an iOS 14.2 report shows a daemon killed in band 1 (aging), an iOS 18.5 report shows
suspended apps at 75 (freezer) and the frontmost app at 100.

Kill reason names are the strings of `memorystatus_kill_cause_name[]` in xnu `bsd/kern/kern_memorystatus.c`
(the JETSAM_REASON_* causes 1-15 of the same header).
"""

from __future__ import annotations

import re

# Band value -> (constant name, what lives there). Values between two bands take the lower band's meaning.
BANDS_BEFORE_16: dict[int, tuple[str, str]] = {
    0: ("IDLE", "idle: suspended apps and idle daemons, killed first"),
    1: ("AGING_BAND1", "aging band 1 (idle deferred): recently active daemons"),
    2: ("AGING_BAND2", "aging band 2 / background opportunistic"),
    3: ("BACKGROUND", "background (also elevated inactive)"),
    4: ("MAIL", "mail / background work"),
    5: ("PHONE", "phone"),
    8: ("UI_SUPPORT", "UI support"),
    9: ("FOREGROUND_SUPPORT", "foreground support (extensions serving the foreground app)"),
    10: ("FOREGROUND", "foreground: the app on screen"),
    12: ("AUDIO_AND_ACCESSORY", "audio and accessory"),
    13: ("CONDUCTOR", "conductor"),
    16: ("HOME", "home screen (SpringBoard)"),
    17: ("EXECUTIVE", "executive"),
    18: ("IMPORTANT", "important (default for daemons)"),
    19: ("CRITICAL", "critical (telephony)"),
    21: ("MAX", "maximum"),
}

BANDS_16_AND_LATER: dict[int, tuple[str, str]] = {
    0: ("IDLE", "idle: suspended apps and idle daemons, killed first"),
    1: ("ENTITLED", "entitled experiment bands 1-9"),
    10: ("AGING_BAND1", "aging band 1 (idle deferred): recently active daemons"),
    20: ("AGING_BAND2", "aging band 2 / background opportunistic"),
    30: ("BACKGROUND", "background"),
    40: ("ELEVATED_INACTIVE", "elevated inactive / background work (formerly mail)"),
    50: ("PHONE", "phone"),
    75: ("FREEZER", "freezer: suspended apps eligible for freezing"),
    80: ("UI_SUPPORT", "UI support"),
    90: ("FOREGROUND_SUPPORT", "foreground support (extensions serving the foreground app)"),
    100: ("FOREGROUND", "foreground: the app on screen"),
    120: ("AUDIO_AND_ACCESSORY", "audio and accessory"),
    130: ("CONDUCTOR", "conductor"),
    150: ("DRIVER_APPLE", "Apple drivers"),
    160: ("HOME", "home screen (SpringBoard)"),
    170: ("EXECUTIVE", "executive"),
    180: ("IMPORTANT", "important (default for daemons)"),
    190: ("CRITICAL", "critical (telephony)"),
    210: ("MAX", "maximum"),
}

KILL_REASONS: dict[str, str] = {
    "jettisoned": "killed without a more specific cause",
    "highwater": "over its high-water mark (a soft limit) while the system needed memory",
    "vnode-limit": "the system ran out of vnodes",
    "vm-pageshortage": "the system ran out of free pages; killed in priority order",
    "vm-thrashing": "the VM compressor was thrashing",
    "proc-thrashing": "the process was thrashing in the compressor",
    "fc-thrashing": "file-cache thrashing",
    "per-process-limit": "crossed its own memory limit (the app's jetsam limit): the footprint is the limit",
    "diagnostic": "diagnostic kill",
    "disk-space-shortage": "the system ran out of disk space",
    "idle-exit": "idle daemon exited to free memory",
    "zone-map-exhaustion": "the kernel zone map was full",
    "vm-compressor-thrashing": "the VM compressor was thrashing",
    "vm-compressor-space-shortage": "the VM compressor ran out of space",
    "low-swap": "swap space ran low",
    "sustained-memory-pressure": "memory pressure lasted too long",
    "vm-pageout-starvation": "the pageout thread was starved",
}

# First OS major version whose reports use the x10 scale, per platform prefix of the report's os_version.
_SCALE_CHANGE = {
    "iphone os": 16,
    "ios": 16,
    "ipados": 16,
    "apple tvos": 16,
    "tvos": 16,
    "watch os": 9,
    "watchos": 9,
    "macos": 13,
    "mac os x": 13,
}
_VERSION = re.compile(r"^\s*(?P<platform>[A-Za-z][A-Za-z ]*?)\s+(?P<major>\d+)(?:\.\d+)*")


def os_major(os_version: str | None) -> tuple[str, int] | None:
    """('iphone os', 18) from 'iPhone OS 18.5 (22F76)'; None when the string is not a version."""
    if not os_version:
        return None
    m = _VERSION.match(os_version)
    if not m:
        return None
    return m.group("platform").lower(), int(m.group("major"))


def priority_scale(os_version: str | None) -> str | None:
    """'x10' for reports from iOS 16 / macOS 13 and later, 'legacy' before, None when the OS is unknown."""
    parsed = os_major(os_version)
    if parsed is None:
        return None
    platform, major = parsed
    first = _SCALE_CHANGE.get(platform)
    if first is None:
        if platform.startswith("visionos") or platform.startswith("xros"):
            return "x10"
        return None
    return "x10" if major >= first else "legacy"


def band_meaning(priority: int, scale: str | None) -> str | None:
    """What a priority value means on the report's scale, e.g. 'FOREGROUND (100): foreground: ...'."""
    if scale is None:
        return None
    bands = BANDS_16_AND_LATER if scale == "x10" else BANDS_BEFORE_16
    if priority < 0:
        return f"{priority}: below IDLE (idle head)"
    at_or_below = [v for v in bands if v <= priority]
    value = max(at_or_below)
    name, meaning = bands[value]
    if value == priority:
        return f"{name} ({priority}): {meaning}"
    above = [v for v in bands if v > priority]
    upper = f", below {bands[min(above)][0]} ({min(above)})" if above else ""
    return f"{priority}: above {name} ({value}){upper}: {meaning}"


def reason_meaning(reason: str) -> str:
    return KILL_REASONS.get(reason, "unknown reason (not in xnu's list of kill causes)")
