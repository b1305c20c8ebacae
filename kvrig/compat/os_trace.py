"""pymobiledevice3's record header for os_trace_relay syslog entries, `_SyslogRecordHeader`: the layout its
public `parse_syslog_entry` reads. The virtual iPhone's os_trace_relay builds its records with it."""

from __future__ import annotations

from pymobiledevice3.services.os_trace import _SyslogRecordHeader

DISTRIBUTION = "pymobiledevice3"
TESTED = ">=11.45,<12"

SyslogRecordHeader = _SyslogRecordHeader
