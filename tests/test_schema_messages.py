"""A file of the wrong shape or kind is named for what it is, in the words of the file, never pydantic's class names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrig.exceptions import SchemaError
from kvrig.schemas import load_model_file
from kvrig.schemas.kvcache import KVCacheConfig
from kvrig.schemas.results import ResultsFile


def test_a_list_where_an_object_belongs_says_so(tmp_path: Path) -> None:
    path = tmp_path / "kvcache.json"
    path.write_text("[1, 2]")
    with pytest.raises(SchemaError) as caught:
        load_model_file(KVCacheConfig, path)
    assert str(caught.value) == f"{path}: not an object, got list (expected an object of named fields)"


def test_a_file_of_another_kind_names_the_keys_this_one_takes(tmp_path: Path) -> None:
    """kvrig calibrate given a kvcache.json said only "unknown key (expected one of the documented keys)"."""
    path = tmp_path / "kvcache.json"
    path.write_text(json.dumps({"scheme": "k8v4", "key_bits": 8}))
    with pytest.raises(SchemaError) as caught:
        load_model_file(ResultsFile, path)
    keys = [info.alias or name for name, info in ResultsFile.model_fields.items()]
    assert caught.value.field == "scheme" and f"expected one of {', '.join(keys)}" in str(caught.value)
    assert "runs" in keys and "KVCacheConfig" not in str(caught.value)


def test_values_no_run_or_phone_can_have_are_refused() -> None:
    """Each was accepted: a shard past the lab's count, a NaN that sorts the limits registry, a NaN gate that
    every run passes, a phone with 10^29 bytes of RAM (printed as 90949470177292816.0 TiB)."""
    from pydantic import ValidationError

    from kvrig.profiles import SourcedInt
    from kvrig.schemas.lab import LabRecord
    from kvrig.schemas.limits import MeasuredLimit
    from kvrig.schemas.results import GateCheck

    with pytest.raises(ValidationError, match="K/N with K from 1 to N"):
        LabRecord(name="lab", shard="3/2")
    assert LabRecord(name="lab", shard="2/2").shard == "2/2"
    limit = {"product_type": "iPhone16,1", "build_version": "23A341", "entitled": True, "limit_bytes": 1 << 30}
    with pytest.raises(ValidationError, match="last_seen"):
        MeasuredLimit.model_validate({**limit, "last_seen": float("nan")})
    with pytest.raises(ValidationError, match="threshold"):
        GateCheck(gate="min_max_safe_context", status="passed", threshold=float("nan"), message="")
    with pytest.raises(ValidationError, match="value"):
        SourcedInt(value=10**29, basis="measured", source="a typo")


def test_an_unknown_key_inside_a_fixed_tuple_names_that_positions_keys() -> None:
    """A `tuple[A, B]` field: an unknown key at position 1 is B's, not A's."""
    from pydantic import ValidationError

    from kvrig.schemas import StrictModel, describe_validation_error

    class First(StrictModel):
        alpha: int = 0

    class Second(StrictModel):
        beta: int = 0

    class Pair(StrictModel):
        pair: tuple[First, Second]

    with pytest.raises(ValidationError) as err:
        Pair.model_validate({"pair": [{}, {"betta": 1}]})
    field, message, expected = describe_validation_error(err.value, Pair)
    assert (field, message, expected) == ("pair.1.betta", "unknown key; did you mean 'beta'?", "one of beta")
