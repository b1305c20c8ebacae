"""os_trace_relay's process list (`PidList`): which processes run, asked over lockdown with no tunnel.

It tells "the app is gone" from "the tunnel is gone": when process control over the tunnel stops answering,
the app may still be running on a phone that is still attached.
"""

from __future__ import annotations

from pymobiledevice3.services.os_trace import OsTraceService

from kvrig.device.discovery import Device


async def running(device: Device) -> dict[int, str]:
    """pid -> process name of every process the phone lists."""
    async with device.errors("listing processes"), OsTraceService(device.lockdown) as trace:
        reply = await trace.get_pid_list()
    payload = reply.get("Payload") if isinstance(reply, dict) else None
    processes: dict[int, str] = {}
    for pid, entry in (payload or {}).items():
        try:
            number = int(pid)
        except (TypeError, ValueError):
            continue  # a torn or foreign entry: not a process
        name = entry.get("ProcessName") if isinstance(entry, dict) else None
        processes[number] = str(name or "")
    return processes


async def pid_of(device: Device, process_name: str) -> int:
    """The pid of a running process with this name (the app's executable), 0 if none runs."""
    for pid, name in sorted((await running(device)).items()):
        if name == process_name:
            return pid
    return 0
