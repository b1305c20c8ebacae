"""kvcache.json schema 2 on the Python side (Swift Core's side runs in tests/appgen/test_core_swift.py): the
new fields, and files of schema 1 refused with the file and the field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrig.exceptions import SchemaError
from kvrig.schemas import load_model_file
from kvrig.schemas.kvcache import KVCACHE_SCHEMA_VERSION, KVCacheConfig

DOC = {
    "schema": 2,
    "scheme": "k4v4",
    "key_bits": 4,
    "value_bits": 4,
    "group_size": 64,
    "quantized_kv_start": 0,
    "rotation": "hadamard_keys",
    "sink_tokens": 4,
    "recent_tokens": 64,
    "page_tokens": 256,
    "max_context": 4096,
    "keep_tokens": 4,
    "prefill_step_size": 256,
    "buffer_cache_limit_bytes": 0,
    "memory_limit_bytes": 0,
    "layers": [{"layer": 0, "kind": "full", "key_bits": 4, "value_bits": 4}],
}


def test_schema_2_reads_the_scheme_fields(tmp_path: Path) -> None:
    path = tmp_path / "kvcache.json"
    path.write_text(json.dumps(DOC))
    kv = load_model_file(KVCacheConfig, path)
    assert KVCACHE_SCHEMA_VERSION == 3
    assert (kv.rotation, kv.sink_tokens, kv.recent_tokens) == ("hadamard_keys", 4, 64)
    # a schema-2 file keeps its number when written back, and reads as a loaded (not mapped) layout
    assert json.loads(kv.model_dump_json(by_alias=True))["schema"] == 2
    assert kv.weights_layout == "loaded"


@pytest.mark.parametrize(
    ("change", "field"),
    [({"schema": 1}, "schema"), ({"recent_tokens": -1}, "recent_tokens"), ({"rotation": "givens"}, "rotation")],
)
def test_bad_kvcache_files_name_the_field(tmp_path: Path, change: dict[str, object], field: str) -> None:
    path = tmp_path / "kvcache.json"
    path.write_text(json.dumps({**DOC, **change}))
    with pytest.raises(SchemaError) as info:
        load_model_file(KVCacheConfig, path)
    assert info.value.file == str(path)
    assert field in str(info.value)
