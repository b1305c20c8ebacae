"""JetsamEvent reports in the phone's format (bug_type 298), written into the crash-report store.

An .ips file is one JSON line of metadata (bug_type, timestamp, os_version, incident_id) then the report
body as pretty-printed JSON: product, build, memoryStatus (pageSize, memoryPages), largestProcess, and
processes[] with pid, name, rpages, lifetimeMax, states, priority, coalition; the victim carries
`reason: per-process-limit`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrig.virtual.state import Identity

# Foreground app priority band (xnu's legacy numbers), and the system daemons every report lists alongside the
# app. From iOS 16 reports carry the bands times ten (a real iOS 18.5 report: the frontmost app at 100).
FOREGROUND_PRIORITY = 10
X10_FROM_IOS = 16


def priority_scale(product_version: str) -> int:
    """1 before iOS 16, 10 from it."""
    major = product_version.split(".")[0]
    return 10 if major.isdigit() and int(major) >= X10_FROM_IOS else 1


SYSTEM_PROCESSES = (
    ("SpringBoard", 34, 7168, 10),
    ("backboardd", 66, 2304, 12),
    ("mediaserverd", 80, 1024, 12),
    ("locationd", 90, 896, 12),
)


@dataclass
class JetsamVictim:
    pid: int
    name: str
    rpages: int
    lifetime_max_pages: int
    uuid: str
    coalition: int
    age_s: float
    cpu_time_s: float


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 100):02d} +0000"


def build_report(
    *,
    phone: Identity,
    victim: JetsamVictim,
    reason: str = "per-process-limit",
    t: float | None = None,
) -> str:
    t = time.time() if t is None else t
    incident = str(uuid.uuid4()).upper()
    os_version = f"iPhone OS {phone.product_version} ({phone.build_version})"
    metadata = {
        "bug_type": "298",
        "timestamp": _stamp(t),
        "os_version": os_version,
        "roots_installed": 0,
        "incident_id": incident,
    }
    scale = priority_scale(phone.product_version)
    processes: list[dict[str, Any]] = []
    for name, pid, rpages, priority in SYSTEM_PROCESSES:
        processes.append(
            {
                "uuid": str(uuid.uuid5(uuid.NAMESPACE_DNS, name)).upper(),
                "states": ["daemon", "idle"] if name != "SpringBoard" else ["daemon"],
                "lifetimeMax": rpages,
                "killDelta": 0,
                "genCount": 0,
                "age": 3_600_000_000,
                "purgeable": 0,
                "fds": 50,
                "coalition": pid,
                "rpages": rpages,
                "priority": priority * scale,
                "physicalPages": {"internal": [rpages, 0]},
                "pid": pid,
                "cpuTime": 12.5,
                "name": name,
            }
        )
    processes.append(
        {
            "uuid": victim.uuid,
            "states": ["frontmost", "resume"],
            "killDelta": 0,
            "genCount": 0,
            "age": int(victim.age_s * 1_000_000_000),
            "purgeable": 0,
            "fds": 25,
            "coalition": victim.coalition,
            "rpages": victim.rpages,
            "priority": FOREGROUND_PRIORITY * scale,
            "reason": reason,
            "physicalPages": {"internal": [victim.rpages, 0]},
            "pid": victim.pid,
            "cpuTime": round(victim.cpu_time_s, 6),
            "name": victim.name,
            "lifetimeMax": victim.lifetime_max_pages,
        }
    )
    total_pages = sum(p["rpages"] for p in processes)
    body = {
        "crashReporterKey": str(uuid.uuid5(uuid.NAMESPACE_OID, phone.product_type)).replace("-", "")[:40],
        "kernel": f"Darwin Kernel Version {phone.product_version}: virtual; root:xnu/RELEASE_ARM64",
        "product": phone.product_type,
        "incident": incident,
        "date": _stamp(t),
        "build": os_version,
        "timeDelta": 1,
        "memoryStatus": {
            "compressorSize": 0,
            "compressions": 0,
            "decompressions": 0,
            "zoneMapCap": 1_073_741_824,
            "largestZone": "APFS_4K_OBJS",
            "largestZoneSize": 35_000_000,
            "pageSize": phone.page_size,
            "uncompressed": 0,
            "zoneMapSize": 200_000_000,
            "memoryPages": {
                "active": total_pages,
                "throttled": 0,
                "fileBacked": 0,
                "wired": 40_000,
                "anonymous": total_pages,
                "purgeable": 0,
                "inactive": 10_000,
                "free": 5_000,
                "speculative": 1_000,
            },
        },
        "largestProcess": max(processes, key=lambda p: p["rpages"])["name"],
        "genCounter": 0,
        "processes": processes,
    }
    return json.dumps(metadata) + "\n" + json.dumps(body, indent=2) + "\n"


def write_report(folder: Path, text: str, t: float | None = None) -> Path:
    t = time.time() if t is None else t
    base = f"JetsamEvent-{time.strftime('%Y-%m-%d-%H%M%S', time.gmtime(t))}"
    path = folder / f"{base}.ips"
    n = 1
    while path.exists():
        path = folder / f"{base}-{n}.ips"
        n += 1
    path.write_text(text)
    return path


# How each fault's process dies, as its crash report says: (exception type, signal, termination).
# The watchdog's termination code is 0x8badf00d (2343432205) in FRONTBOARD's namespace, as real .ips reports
# give it; an abort is SIGABRT with the message in `asi` (application-specific information).
CRASH_KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "segv": ("EXC_BAD_ACCESS", "SIGSEGV", {"namespace": "SIGNAL", "indicator": "Segmentation fault: 11"}),
    "abort": ("EXC_CRASH", "SIGABRT", {"namespace": "SIGNAL", "code": 6, "indicator": "Abort trap: 6"}),
    "watchdog": (
        "EXC_CRASH",
        "SIGKILL",
        {"namespace": "FRONTBOARD", "code": 2343432205, "indicator": "scene-update watchdog transgression"},
    ),
}


def build_crash_report(
    *,
    phone: Identity,
    pid: int,
    name: str,
    bundle_id: str,
    signal: str = "SIGSEGV",
    kind: str = "segv",
    message: str | None = None,
) -> str:
    """A minimal app crash report (bug_type 309): a segfault, an abort with its message, or a watchdog kill."""
    t = time.time()
    os_version = f"iPhone OS {phone.product_version} ({phone.build_version})"
    incident = str(uuid.uuid4()).upper()
    metadata = {
        "bug_type": "309",
        "timestamp": _stamp(t),
        "os_version": os_version,
        "name": name,
        "bundleID": bundle_id,
        "incident_id": incident,
    }
    body: dict[str, Any] = {
        "incident": incident,
        "procName": name,
        "pid": pid,
        "modelCode": phone.product_type,
        "osVersion": {"train": f"iPhone OS {phone.product_version}", "build": phone.build_version},
        "bundleInfo": {"CFBundleIdentifier": bundle_id},
        "exception": {"type": CRASH_KINDS[kind][0], "signal": signal if kind == "segv" else CRASH_KINDS[kind][1]},
        "termination": CRASH_KINDS[kind][2],
        "threads": [],
        "usedImages": [],
    }
    if message is not None:
        body["asi"] = {"libc++abi.dylib": [message]}
    return json.dumps(metadata) + "\n" + json.dumps(body, indent=2) + "\n"
