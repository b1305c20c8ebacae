"""Contracts that cross a boundary (the Swift app, CI, a later run): one module per file format.

Every model rejects unknown keys and carries a `schema` version; `json_schema(Model)` exports the JSON Schema
for files the app reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kvrig.exceptions import InputError, SchemaError
from kvrig.fileio import read_data


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


M = TypeVar("M", bound=BaseModel)


def describe_validation_error(exc: ValidationError) -> tuple[str, str, str]:
    """First error as (field path, message, expected)."""
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return field, "unknown key", "one of the documented keys"
    if kind == "missing":
        return field, "missing", "a value"
    got = err.get("input")
    shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
    return field, f"{err.get('msg', 'invalid')}, got {shown}", ""


def load_model_file(model: type[M], path: str | Path, *, error: type[SchemaError] = SchemaError) -> M:
    """Reads a JSON file into `model`, naming the file and the field at fault on any error."""
    return validate_data(model, read_data(path, error=error), file=path, error=error)


def validate_data(
    model: type[M], data: Any, *, file: str | Path | None = None, error: type[InputError] = SchemaError
) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        field, message, expected = describe_validation_error(exc)
        raise error(message, file=file, field=field, expected=expected or None) from None


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(by_alias=True)
