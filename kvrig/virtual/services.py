"""The services a virtual iPhone's lockdownd starts, by name: each handler imported where a reader (and a tool)
can follow it, with how it is offered (TLS, developer-only, counted by the AFC unplug fault, the first iOS
that has it, a tunnel)."""

from __future__ import annotations

from kvrig.virtual.afc import serve_media
from kvrig.virtual.amfi import serve_amfi
from kvrig.virtual.coredevice_proxy import serve_coredevice_proxy
from kvrig.virtual.crash_reports import serve_copy_mobile, serve_mover
from kvrig.virtual.diagnostics_relay import serve_diagnostics_relay
from kvrig.virtual.dtx import serve_instruments
from kvrig.virtual.heartbeat import serve_heartbeat
from kvrig.virtual.house_arrest import serve_house_arrest
from kvrig.virtual.image_mounter import serve_image_mounter
from kvrig.virtual.installation_proxy import serve_installation_proxy
from kvrig.virtual.phone import ServiceSpec
from kvrig.virtual.syslog import serve_os_trace_relay, serve_syslog_relay

SERVICES: dict[str, ServiceSpec] = {
    "com.apple.afc": ServiceSpec(serve_media, counts_afc=True),
    "com.apple.mobile.house_arrest": ServiceSpec(serve_house_arrest, counts_afc=True),
    "com.apple.mobile.installation_proxy": ServiceSpec(serve_installation_proxy),
    "com.apple.crashreportcopymobile": ServiceSpec(serve_copy_mobile, counts_afc=True),
    "com.apple.crashreportmover": ServiceSpec(serve_mover),
    "com.apple.syslog_relay": ServiceSpec(serve_syslog_relay),
    "com.apple.os_trace_relay": ServiceSpec(serve_os_trace_relay),
    "com.apple.instruments.remoteserver.DVTSecureSocketProxy": ServiceSpec(serve_instruments, ssl=True, developer=True),
    "com.apple.mobile.mobile_image_mounter": ServiceSpec(serve_image_mounter),
    "com.apple.amfi.lockdown": ServiceSpec(serve_amfi, min_ios=(16, 0)),
    "com.apple.mobile.heartbeat": ServiceSpec(serve_heartbeat, ssl=True),
    "com.apple.mobile.diagnostics_relay": ServiceSpec(serve_diagnostics_relay),
    "com.apple.iosdiagnostics.relay": ServiceSpec(serve_diagnostics_relay),
    "com.apple.internal.devicecompute.CoreDeviceProxy": ServiceSpec(
        serve_coredevice_proxy, ssl=True, min_ios=(17, 4), tunnel=True
    ),
}
