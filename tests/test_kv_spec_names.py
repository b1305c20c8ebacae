"""A KV spec reads back from the kvcache.json it was written into: what `kvrig run` prints is what `--kv` took."""

from __future__ import annotations

import pytest

from kvrig.bundle.kvcache_json import kv_fields
from kvrig.recipes import parse_kv
from kvrig.schemas.kvcache import LayerCache, host_kvcache


@pytest.mark.parametrize(
    "text", ["fp16", "k8v4", "k8v4+rot", "k4v4+rotk+s4+w64", "k3v3g32+rot+w16", "k4v4+k8@0+s4", "k8v8+s4"]
)
def test_the_spec_kvcache_json_holds_is_the_one_written(text: str) -> None:
    spec = parse_kv(text)
    config = host_kvcache([LayerCache(layer=0, kind="full")], max_context=64, prefill_step_size=8, **kv_fields(spec))
    assert config.spec == spec.name == text
