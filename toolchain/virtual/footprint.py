"""Footprint accounting for a launched app: what jetsam would compare against the limit.

The app process reports measured quantities (MLX allocator active and cache bytes, KV-cache nbytes, weight
bytes); the emulator plays the kernel and computes

    footprint = baseline + max(mlx_active, weights + kv) + mlx_cache + phone_format_delta

`max` because weights and KV caches are MLX arrays and so already inside `mlx_active` on the phone, but a
host runtime may map weights outside the allocator; `phone_format_delta` is what the app says the phone's
format would add or save for the same shapes (fp32 host activations vs fp16 on the phone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        return cls(**{k: int(v) for k, v in data.items() if k in cls.__dataclass_fields__})


def footprint_bytes(m: Measurement, baseline_bytes: int = BASELINE_BYTES) -> int:
    resident = max(m.mlx_active_bytes, m.weight_bytes + m.kv_bytes)
    return max(0, baseline_bytes + resident + m.mlx_cache_bytes + m.phone_format_delta_bytes)


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
    lifetime_max_bytes: int = 0
    last: Measurement = field(default_factory=Measurement)

    def update(self, m: Measurement) -> int:
        self.last = m
        self.current_bytes = footprint_bytes(m, self.baseline_bytes)
        self.lifetime_max_bytes = max(self.lifetime_max_bytes, self.current_bytes)
        return self.current_bytes

    @property
    def over_limit(self) -> bool:
        return self.current_bytes >= self.limit_bytes

    @property
    def available_bytes(self) -> int:
        return max(0, self.limit_bytes - self.current_bytes)

    @property
    def rpages(self) -> int:
        return pages(self.current_bytes, self.page_size)

    @property
    def lifetime_max_pages(self) -> int:
        return pages(self.lifetime_max_bytes, self.page_size)
