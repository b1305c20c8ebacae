"""Read JetsamEvent reports (bug_type 298, `.ips` / `.ips.synced`) from iOS 10 onwards.

pycrashreport reads the envelope (the one-line JSON header: bug_type, incident, timestamp); this module
reads the JetsamEvent body it leaves opaque. Fields come and go across iOS versions, so every body field is
optional: a missing or mistyped field becomes None plus a line in `problems`, and the report is marked
`partial` rather than refused. A file that is not a JetsamEvent is refused with NotAJetsamReportError.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from kvrig.compat.crash_report import report_header
from kvrig.exceptions import NotAJetsamReportError, ReportError
from kvrig.profiles import find_profile_by_product_type
from kvrig.reports.jetsam_codes import band_meaning, priority_scale, reason_meaning

JETSAM_BUG_TYPES = {"298"}  # "198" / "98" are older Jetsam bug types pycrashreport knows; never seen as JSON
MAX_REPORT_BYTES = 64 * 1024 * 1024  # real reports are ~0.1-0.5 MB; refuse before reading something huge
_FREEZE_KEYS = ("freeze_skip_reason:", "freeze_skip_reason")  # the real key has a trailing colon
_PAGE_KINDS = (
    "free",
    "active",
    "inactive",
    "speculative",
    "throttled",
    "wired",
    "purgeable",
    "fileBacked",
    "anonymous",
)


class MemoryStatus(BaseModel):
    """System memory at the event, in bytes (pages × page size)."""

    page_size: int | None
    pages: dict[str, int] = Field(default_factory=dict, description="raw memoryPages counts")
    bytes: dict[str, int] = Field(default_factory=dict, description="memoryPages counts × page size")
    compressed_bytes: int | None = Field(None, description="compressorSize × page size")
    uncompressed_bytes: int | None = Field(None, description="what the compressor holds, uncompressed")
    zone_map_bytes: int | None = None
    largest_zone: str | None = None


class JetsamProcess(BaseModel):
    name: str | None
    pid: int | None
    rpages: int | None
    footprint_bytes: int | None = Field(None, description="rpages × pageSize")
    lifetime_max_pages: int | None = None
    lifetime_peak_bytes: int | None = None
    states: list[str] = Field(default_factory=list)
    priority: int | None = None
    priority_band: str | None = Field(None, description="meaning of `priority` on this report's OS scale")
    reason: str | None = Field(None, description="present only on killed processes")
    reason_meaning: str | None = None
    implied_limit_bytes: int | None = Field(
        None,
        description="per-process-limit kills: the footprint at the kill, which the limit in force did not exceed "
        "(limits can drop, e.g. when a daemon goes idle, so the lifetime peak may be higher)",
    )
    freeze_skip_reason: str | None = None

    @property
    def killed(self) -> bool:
        return self.reason is not None


class JetsamReport(BaseModel):
    file: str
    bug_type: str
    os_version: str | None
    priority_scale: str | None = Field(None, description="'legacy' (before iOS 16), 'x10' (16+) or unknown")
    product: str | None
    profile: str | None = Field(None, description="our device profile for `product`, when we have one")
    timestamp: str | None
    incident_id: str | None
    page_size: int | None
    memory: MemoryStatus
    largest_process: str | None
    largest_process_bytes: int | None = None
    processes: list[JetsamProcess]
    killed: list[JetsamProcess]
    partial: bool = False
    processes_complete: bool = Field(
        True, description="False: the process list was cut or damaged, so a process missing from it may have run"
    )
    problems: list[str] = Field(default_factory=list)

    def process_named(self, name: str) -> list[JetsamProcess]:
        return [p for p in self.processes if p.name == name]


class Verdict(BaseModel):
    """What a report says about one process (our app)."""

    file: str
    process: str
    present: bool
    killed: bool
    reason: str | None = None
    reason_meaning: str | None = None
    footprint_bytes: int | None = None
    implied_limit_bytes: int | None = None
    lifetime_peak_bytes: int | None = None
    states: list[str] = Field(default_factory=list)
    priority: int | None = None
    priority_band: str | None = None
    largest: bool = False
    candidates: list[str] = Field(
        default_factory=list,
        description="when `process` is not in the report: the processes that could be the app (killed, then "
        "frontmost), to pass instead",
    )
    summary: str


# --- reading ------------------------------------------------------------------------------------------


def read_report(path: str | Path) -> JetsamReport:
    """Parses one JetsamEvent report; ReportError / NotAJetsamReportError name the file and the field."""
    path = Path(path)
    text = _read_text(path)
    header, body_text = _envelope(text, path)
    bug_type = str(header.get("bug_type"))
    if bug_type not in JETSAM_BUG_TYPES:
        kind = _describe_bug_type(bug_type)
        raise NotAJetsamReportError(
            f"not a JetsamEvent report: bug_type {bug_type} ({kind})",
            file=path,
            field="bug_type",
            expected="298",
        )
    problems: list[str] = []
    body, salvaged = _parse_body(body_text, path, problems)
    return _build(path, header, body, problems, processes_complete=not salvaged)


def _read_text(path: Path) -> str:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ReportError("file not found", file=path) from None
    except OSError as exc:
        raise ReportError(f"cannot read: {exc.strerror or exc}", file=path) from None
    if path.is_dir():
        raise ReportError("is a directory, not a report", file=path)
    if size > MAX_REPORT_BYTES:
        raise ReportError(
            f"file is {size} bytes, too large for a JetsamEvent report",
            file=path,
            expected=f"at most {MAX_REPORT_BYTES} bytes",
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ReportError(f"cannot read: {exc.strerror or exc}", file=path) from None
    if not data.strip():
        raise NotAJetsamReportError("empty file", file=path, expected="a JetsamEvent report (.ips)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotAJetsamReportError(
            f"not UTF-8 text (byte {exc.start})", file=path, expected="a JetsamEvent report (.ips)"
        ) from None


def _envelope(text: str, path: Path) -> tuple[dict[str, Any], str]:
    """(header, body text). The header comes from pycrashreport; a whole-file JSON object (old exports)
    is its own header."""
    try:
        from pycrashreport.crash_report import get_crash_report_from_buf
    except ImportError:
        raise ReportError(
            "reading crash-report envelopes needs pycrashreport",
            file=path,
            expected="pip install 'kvrig[device]'",
        ) from None

    first, _, rest = text.partition("\n")
    try:
        envelope = get_crash_report_from_buf(text, filename=str(path))
        header = report_header(envelope)
    except Exception:  # its parser fails in many ways on garbage; for us that only means "no header"
        header = None
    if isinstance(header, dict) and "bug_type" in header:
        # A one-line file whose only object has memoryStatus/processes is header and body at once.
        if not rest.strip() and ("processes" in header or "memoryStatus" in header):
            return header, first
        return header, rest
    whole = _loads_or_none(text)
    if isinstance(whole, dict) and ({"bug_type", "processes", "memoryStatus"} & whole.keys()):
        # Old exports: the whole report is one JSON object, header fields included.
        return {**whole, "bug_type": str(whole.get("bug_type", "298"))}, text
    if isinstance(header, dict):
        raise NotAJetsamReportError(
            "header has no bug_type: not a crash report", file=path, field="bug_type", expected="298"
        )
    if isinstance(whole, dict | list):
        raise NotAJetsamReportError(
            "JSON without a crash-report header (an analytics log or other JSON?)",
            file=path,
            field="bug_type",
            expected="a first line with bug_type 298",
        )
    if _loads_or_none(first) is None and first.lstrip().startswith("{"):
        raise ReportError(
            "header line is not valid JSON (truncated or corrupted?)",
            file=path,
            field="header",
            expected="a one-line JSON header with bug_type",
        )
    raise NotAJetsamReportError(
        "not a crash report: the first line is not a JSON header",
        file=path,
        field="header",
        expected="a one-line JSON header with bug_type 298",
    )


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _describe_bug_type(bug_type: str) -> str:
    from pycrashreport.crash_report import BugType

    try:
        return BugType(bug_type).name
    except ValueError:
        return "unknown kind"


def _parse_body(body_text: str, path: Path, problems: list[str]) -> tuple[dict[str, Any], bool]:
    """(the body, whether it was salvaged from invalid JSON: its processes are only those before the damage)."""
    if not body_text.strip():
        raise ReportError("header only: the JetsamEvent body is missing", file=path, field="body")
    try:
        body = json.loads(body_text)
    except RecursionError:
        raise ReportError("body JSON nests too deeply", file=path, field="body") from None
    except json.JSONDecodeError as exc:
        body = _salvage(body_text)
        if body is None:
            raise ReportError(
                f"body is not valid JSON ({exc.msg} at line {exc.lineno}) and nothing could be kept",
                file=path,
                field="body",
                expected="a JSON object",
            ) from None
        kept = len(body.get("processes", []))
        problems.append(f"body: invalid JSON ({exc.msg}, line {exc.lineno}); kept {kept} complete processes")
        salvaged = True
    else:
        salvaged = False
    if not isinstance(body, dict):
        raise ReportError(
            f"body is a JSON {type(body).__name__}, not an object",
            file=path,
            field="body",
            expected="a JSON object",
        )
    return body, salvaged


def _salvage(text: str) -> dict[str, Any] | None:
    """Keeps what a truncated body still holds: the fields before `processes` and every complete process.

    Real reports put build/product/memoryStatus/largestProcess before the (long) processes array, so a
    report cut anywhere in that array keeps its header and all processes written so far.
    """
    key = text.find('"processes"')
    if key < 0:
        return None
    head = text[:key].rstrip().rstrip(",")
    fields = _loads_or_none(head + "}")
    if not isinstance(fields, dict):
        return None
    decoder = json.JSONDecoder()
    pos = text.find("[", key)
    processes: list[Any] = []
    if pos >= 0:
        pos += 1
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except (json.JSONDecodeError, RecursionError):
                break
            processes.append(obj)
    fields["processes"] = processes
    return fields


# --- building the model ---------------------------------------------------------------------------------


def _int(obj: dict[str, Any], key: str, where: str, problems: list[str], *, count: bool = False) -> int | None:
    """The integer at `key`; `count`: a number of pages, which cannot be negative."""
    if key not in obj:
        return None
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{where}.{key}: expected an integer, got {type(value).__name__} {value!r:.40}")
        return None
    if count and value < 0:
        problems.append(f"{where}.{key}: expected a page count >= 0, got {value}")
        return None
    return value


def _str(obj: dict[str, Any], key: str, where: str, problems: list[str]) -> str | None:
    if key not in obj:
        return None
    value = obj[key]
    if not isinstance(value, str):
        problems.append(f"{where}.{key}: expected a string, got {type(value).__name__}")
        return None
    return value


def _mul(a: int | None, b: int | None) -> int | None:
    return a * b if a is not None and b is not None else None


def _build(
    path: Path, header: dict[str, Any], body: dict[str, Any], problems: list[str], *, processes_complete: bool
) -> JetsamReport:
    os_version = _str(body, "build", "body", problems) or _header_str(header, "os_version")
    scale = priority_scale(os_version)
    if os_version is None:
        problems.append("body.build: missing (OS version unknown, priority bands not interpreted)")

    mem_raw = body.get("memoryStatus")
    if mem_raw is None:
        problems.append("body.memoryStatus: missing")
        mem_raw = {}
    elif not isinstance(mem_raw, dict):
        problems.append(f"body.memoryStatus: expected an object, got {type(mem_raw).__name__}")
        mem_raw = {}
    page_size = _int(mem_raw, "pageSize", "memoryStatus", problems)
    if page_size is None:
        page_size = _int(body, "pageSize", "body", problems)  # some exports keep it at the top level
    if page_size is not None and page_size <= 0:
        problems.append(f"memoryStatus.pageSize: expected a positive page size, got {page_size}")
        page_size = None
    if page_size is None:
        problems.append("memoryStatus.pageSize: missing, so no byte counts (pages are 4096 or 16384 B)")
    memory = _memory(mem_raw, page_size, problems)

    raw_processes = body.get("processes")
    if raw_processes is None:
        problems.append("body.processes: missing")
        raw_processes, processes_complete = [], False
    elif not isinstance(raw_processes, list):
        problems.append(f"body.processes: expected a list, got {type(raw_processes).__name__}")
        raw_processes, processes_complete = [], False
    processes = []
    for i, raw in enumerate(raw_processes):
        if not isinstance(raw, dict):
            problems.append(f"processes[{i}]: expected an object, got {type(raw).__name__}")
            processes_complete = False
            continue
        processes.append(_process(raw, f"processes[{i}]", page_size, scale, problems))

    largest = _str(body, "largestProcess", "body", problems)
    if "largestProcess" not in body:
        problems.append("body.largestProcess: missing")
    largest_bytes = None
    if largest is not None:
        sizes = [p.footprint_bytes for p in processes if p.name == largest and p.footprint_bytes is not None]
        largest_bytes = max(sizes) if sizes else None

    product = _str(body, "product", "body", problems)
    if product is None and "product" not in body:
        problems.append("body.product: missing")
    return JetsamReport(
        file=str(path),
        bug_type=str(header.get("bug_type")),
        os_version=os_version,
        priority_scale=scale,
        product=product,
        profile=_profile_name(product),
        timestamp=_header_str(header, "timestamp") or _str(body, "date", "body", problems),
        incident_id=_header_str(header, "incident_id") or _str(body, "incident", "body", problems),
        page_size=page_size,
        memory=memory,
        largest_process=largest,
        largest_process_bytes=largest_bytes,
        processes=processes,
        killed=[p for p in processes if p.killed],
        partial=bool(problems),
        processes_complete=processes_complete,
        problems=problems,
    )


def _header_str(header: dict[str, Any], key: str) -> str | None:
    value = header.get(key)
    return value if isinstance(value, str) else None


def _memory(raw: dict[str, Any], page_size: int | None, problems: list[str]) -> MemoryStatus:
    pages_raw = raw.get("memoryPages", {})
    if not isinstance(pages_raw, dict):
        problems.append(f"memoryStatus.memoryPages: expected an object, got {type(pages_raw).__name__}")
        pages_raw = {}
    pages: dict[str, int] = {}
    for kind in _PAGE_KINDS:
        n = _int(pages_raw, kind, "memoryStatus.memoryPages", problems)
        if n is not None:
            pages[kind] = n
    return MemoryStatus(
        page_size=page_size,
        pages=pages,
        bytes={k: v * page_size for k, v in pages.items()} if page_size else {},
        compressed_bytes=_mul(_int(raw, "compressorSize", "memoryStatus", problems), page_size),
        uncompressed_bytes=_mul(_int(raw, "uncompressed", "memoryStatus", problems), page_size),
        zone_map_bytes=_int(raw, "zoneMapSize", "memoryStatus", problems),
        largest_zone=_str(raw, "largestZone", "memoryStatus", problems),
    )


def _process(
    raw: dict[str, Any], where: str, page_size: int | None, scale: str | None, problems: list[str]
) -> JetsamProcess:
    rpages = _int(raw, "rpages", where, problems, count=True)
    lifetime = _int(raw, "lifetimeMax", where, problems, count=True)
    priority = _int(raw, "priority", where, problems)
    reason = _str(raw, "reason", where, problems)
    states_raw = raw.get("states", [])
    if isinstance(states_raw, list) and all(isinstance(s, str) for s in states_raw):
        states = list(states_raw)
    else:
        problems.append(f"{where}.states: expected a list of strings")
        states = []
    footprint = _mul(rpages, page_size)
    freeze = next((raw[k] for k in _FREEZE_KEYS if isinstance(raw.get(k), str)), None)
    return JetsamProcess(
        name=_str(raw, "name", where, problems),
        pid=_int(raw, "pid", where, problems),
        rpages=rpages,
        footprint_bytes=footprint,
        lifetime_max_pages=lifetime,
        lifetime_peak_bytes=_mul(lifetime, page_size),
        states=states,
        priority=priority,
        priority_band=band_meaning(priority, scale) if priority is not None else None,
        reason=reason,
        reason_meaning=reason_meaning(reason) if reason is not None else None,
        implied_limit_bytes=footprint if reason == "per-process-limit" else None,
        freeze_skip_reason=freeze,
    )


def _profile_name(product: str | None) -> str | None:
    """Our device profile's name for a ProductType, if the profiles module knows it (the one place)."""
    if not product:
        return None
    try:
        profile = find_profile_by_product_type(product)
    except Exception:  # a broken profile file must not make a jetsam report unreadable
        return None
    return getattr(profile, "name", None) if profile is not None else None


# --- the verdict for one process ------------------------------------------------------------------------


def verdict(report: JetsamReport, process: str) -> Verdict:
    """Was `process` killed in this report, why, and at what footprint."""
    entries = report.process_named(process)
    largest = report.largest_process == process
    if not entries:
        candidates = _candidates(report)
        if _looks_like_bundle_id(process):
            # JetsamEvent reports name each process by its executable (CFBundleExecutable), never by bundle id.
            summary = f"{process} looks like a bundle id; JetsamEvent reports name processes by executable"
        elif not report.processes_complete:
            # a cut or damaged process list says nothing of the processes it lost
            summary = f"{process} is not among the processes this damaged report kept: whether it ran is unknown"
        else:
            summary = f"{process} is not in this report: it was not running (or not tracked) at the event"
        if candidates:
            summary += f"; the app may be one of: {', '.join(candidates)} (pass its executable name as --process)"
        return Verdict(
            file=report.file,
            process=process,
            present=False,
            killed=False,
            largest=largest,
            candidates=candidates,
            summary=summary,
        )
    killed = [p for p in entries if p.killed]
    entry = killed[0] if killed else max(entries, key=lambda p: p.rpages or 0)
    footprint = _fmt_bytes(entry.footprint_bytes, "no rpages for it" if entry.rpages is None else "no page size")
    if killed:
        summary = f"{process} was killed ({entry.reason}: {entry.reason_meaning}) at a footprint of {footprint}"
        if entry.implied_limit_bytes is not None:
            summary += f"; its memory limit was at most {_fmt_bytes(entry.implied_limit_bytes, 'no page size')}"
    else:
        summary = f"{process} was not killed; footprint {footprint}"
    return Verdict(
        file=report.file,
        process=process,
        present=True,
        killed=bool(killed),
        largest=largest,
        summary=summary,
        # what the report says of the process itself: every field the two models share
        **entry.model_dump(include=set(Verdict.model_fields) & set(JetsamProcess.model_fields)),
    )


def _looks_like_bundle_id(name: str) -> bool:
    """com.example.App: reverse-DNS, at least two dots' worth of parts, no spaces (executables rarely are)."""
    parts = name.split(".")
    return len(parts) >= 3 and all(parts) and " " not in name


def _candidates(report: JetsamReport) -> list[str]:
    """Processes that could be an app: the killed ones, then the frontmost ones (an app in the foreground)."""
    names = [p.name for p in report.killed] + [p.name for p in report.processes if "frontmost" in p.states]
    return list(dict.fromkeys(n for n in names if n))


def _fmt_bytes(n: int | None, why_unknown: str) -> str:
    if n is None:
        return f"unknown ({why_unknown})"
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def report_time(report: JetsamReport) -> datetime | None:
    """The report's timestamp ('2025-05-28 01:35:47.00 -0500') as an aware datetime, if it parses."""
    if not report.timestamp:
        return None
    for fmt in ("%Y-%m-%d %H:%M:%S.%f %z", "%Y-%m-%d %H:%M:%S %z"):
        try:
            return datetime.strptime(report.timestamp, fmt)
        except ValueError:
            continue
    return None
