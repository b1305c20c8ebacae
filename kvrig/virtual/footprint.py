"""Footprint accounting for a launched app: what jetsam would compare against the limit.

The app process reports measured quantities after each step (MLX allocator active, cache and peak bytes,
KV-cache nbytes, weight bytes, the weight bytes it maps from the bundle's file); the emulator plays the kernel
and computes the footprint at the measurement

    footprint = baseline + max(mlx_active + phone_format_delta, weights + kv) - mapped_weights + mlx_cache

and the peak within the step, which is what iOS charges (every page when it is touched, so a transient
inside a forward pass counts):

    peak = baseline + max(mlx_peak + phone_format_peak_delta - mapped_weights, <the footprint's resident part>)
           + mlx_cache

`max` because weights and KV caches are MLX arrays and so already inside `mlx_active` on the phone, but a
host runtime may map weights outside the allocator; the two deltas are what the app says the phone's format
would add or save for the same shapes (fp32 host activations vs fp16 on the phone). MLX reports the peak of
active memory only, so its buffer cache at the measurement stands in for the cache at the peak.

An app whose cache is uncapped (`mlx_cache_uncapped`: it never sets the cap nor empties the cache) never gives
memory back: MLX moves a freed buffer into the cache and a reused one out of it, so active + cache never falls
within a step, and its highest point is the measurement's. The step's transients are inside the cache then
(freed there), so adding the cache to the active peak would count them twice; the peak is

    peak = max(footprint, baseline + mlx_peak + phone_format_peak_delta - mapped_weights)

Mapped weights: an app that maps the bundle's weights read-only hands MLX the file's pages without a copy.
MLX still counts them as active memory (Metal's allocator adds a no-copy buffer's length to its active bytes),
but they are clean, file-backed pages the kernel can drop and read back, so iOS leaves them out of the
footprint: the kernel subtracts `mapped_weight_bytes` (at most the weights the app reports) from what MLX
holds, at the measurement and at the peak.

When the peak crosses the limit the process dies at the page that crossed it: the kill's footprint is the
first whole page above the limit, not the step's peak (the allocation that would have reached it never
completed).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Assumed footprint of the app with no model loaded (runtime, Metal, SwiftUI). Not measured here: an
# estimate for an empty SwiftUI app; pass `baseline_bytes` to use a measured one.
BASELINE_BYTES = 48 * 1024 * 1024
WARNING_FRACTION = 0.80
CRITICAL_FRACTION = 0.90


@dataclass(frozen=True)
class Measurement:
    mlx_active_bytes: int = 0
    mlx_cache_bytes: int = 0
    kv_bytes: int = 0
    weight_bytes: int = 0
    context_tokens: int = 0
    phone_format_delta_bytes: int = 0
    mlx_peak_bytes: int = 0
    """MLX's peak active memory since the previous measurement (the app resets it after each)."""
    phone_format_peak_delta_bytes: int = 0
    mapped_weight_bytes: int = 0
    """Weight bytes the app maps from the bundle's file: inside `mlx_active_bytes` and `weight_bytes`, outside
    the footprint (clean, file-backed pages)."""
    mlx_cache_uncapped: int = 0
    """1: the app never caps nor empties MLX's buffer cache (active + cache never falls within a step)."""

    @property
    def file_backed_bytes(self) -> int:
        """What the kernel leaves out of the footprint: the mapped weights, never more than the weights."""
        return min(max(0, self.mapped_weight_bytes), max(0, self.weight_bytes))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        return cls(**{k: int(v) for k, v in data.items() if k in cls.__dataclass_fields__})


def _resident(m: Measurement) -> int:
    return max(m.mlx_active_bytes + m.phone_format_delta_bytes, m.weight_bytes + m.kv_bytes) - m.file_backed_bytes


def footprint_bytes(m: Measurement, baseline_bytes: int = BASELINE_BYTES) -> int:
    """The footprint at the measurement (what the app's own phys_footprint query returns then)."""
    return max(0, baseline_bytes + _resident(m) + m.mlx_cache_bytes)


def peak_footprint_bytes(m: Measurement, baseline_bytes: int = BASELINE_BYTES) -> int:
    """The highest footprint within the step that ended at this measurement."""
    peak = m.mlx_peak_bytes + m.phone_format_peak_delta_bytes - m.file_backed_bytes if m.mlx_peak_bytes else 0
    if m.mlx_cache_uncapped:
        return max(footprint_bytes(m, baseline_bytes), baseline_bytes + peak)
    return max(0, baseline_bytes + max(_resident(m), peak) + m.mlx_cache_bytes)


def pages(nbytes: int, page_size: int) -> int:
    return math.ceil(nbytes / page_size)


def pressure_level(footprint: int, limit: int) -> str:
    if footprint >= CRITICAL_FRACTION * limit:
        return "critical"
    if footprint >= WARNING_FRACTION * limit:
        return "warning"
    return "normal"


@dataclass
class FootprintAccount:
    """Footprint of one process over its life, against one limit."""

    limit_bytes: int
    page_size: int
    baseline_bytes: int = BASELINE_BYTES
    current_bytes: int = 0
    """At the last measurement; at the kill, the footprint the kernel killed at."""
    peak_bytes: int = 0
    """The peak within the last step."""
    lifetime_max_bytes: int = 0
    last: Measurement = field(default_factory=Measurement)

    def update(self, m: Measurement) -> int:
        """Accounts one step; returns the footprint at its measurement. If the step's peak crossed the limit,
        the process was killed at the first page above it, which becomes the current footprint."""
        self.last = m
        self.current_bytes = footprint_bytes(m, self.baseline_bytes)
        self.peak_bytes = max(self.current_bytes, peak_footprint_bytes(m, self.baseline_bytes))
        if self.over_limit:
            self.current_bytes = self.peak_bytes = self.kill_bytes
        self.lifetime_max_bytes = max(self.lifetime_max_bytes, self.peak_bytes)
        return self.current_bytes

    @property
    def kill_bytes(self) -> int:
        """The footprint when the page that crosses the limit is charged (the ledger fires above the limit)."""
        return (self.limit_bytes // self.page_size + 1) * self.page_size

    @property
    def over_limit(self) -> bool:
        return self.peak_bytes > self.limit_bytes

    @property
    def available_bytes(self) -> int:
        return max(0, self.limit_bytes - self.current_bytes)

    @property
    def rpages(self) -> int:
        return pages(self.current_bytes, self.page_size)

    @property
    def lifetime_max_pages(self) -> int:
        return pages(self.lifetime_max_bytes, self.page_size)


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of a live process: Linux's /proc, else ps (macOS has no /proc); 0 where neither
    says."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        pass
    try:
        shown = subprocess.run(["ps", "-o", "time=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return 0.0
    return ps_time_seconds(shown.stdout) if shown.returncode == 0 else 0.0


def ps_time_seconds(text: str) -> float:
    """ps's `time` column ([[DD-]HH:]MM:SS[.ss]: procps prints HH:MM:SS, macOS M:SS.ss) in seconds; 0 if not one."""
    found = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", text.strip())
    if found is None:
        return 0.0
    days, hours, minutes, seconds = found.groups()
    return ((int(days or 0) * 24 + int(hours or 0)) * 60 + int(minutes)) * 60 + float(seconds)
