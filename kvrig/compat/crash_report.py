"""The parts of a pycrashreport report it keeps private: `_metadata` (the header line's JSON object) and
`_data` (the body, parsed JSON for .ips reports). pycrashreport exposes only a few header fields (bug_type,
name, timestamp) and none of a jetsam report's body (memoryStatus, processes)."""

from __future__ import annotations

from typing import Any

DISTRIBUTION = "pycrashreport"
TESTED = ">=2,<3"


def report_header(report: Any) -> Any:
    """The header object of a report from `get_crash_report_from_buf`."""
    return report._metadata


def report_body(report: Any) -> Any:
    """The body of a report from `get_crash_report_from_buf` (a dict for JSON reports, else text)."""
    return report._data
