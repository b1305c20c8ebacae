"""Contracts that cross a boundary (the Swift app, CI, a later run): one module per file format.

Every model rejects unknown keys and carries a `schema` version; `json_schema(Model)` exports the JSON Schema
for files the app reads.
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kvrig.exceptions import InputError, SchemaError
from kvrig.fileio import read_data


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


M = TypeVar("M", bound=BaseModel)


def describe_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> tuple[str, str, str]:
    """The first error as (field path, "" for the whole file; message; expected). An unknown key comes before the
    missing ones (a misspelt key is both), with the missing key it most likely meant; at the top of a file of
    `model`, the keys it takes are named (a file of another kind shows at once)."""
    errors = exc.errors()
    err = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    loc = tuple(err.get("loc", ()))
    field = ".".join(str(p) for p in loc)
    kind = err.get("type", "")
    got = err.get("input")
    shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
    if kind == "extra_forbidden":
        missing = [str(e["loc"][-1]) for e in errors if e.get("type") == "missing" and tuple(e["loc"][:-1]) == loc[:-1]]
        meant = difflib.get_close_matches(str(loc[-1]), missing, n=1) if loc else []
        # The object the key sits in, at any depth: its keys are named, and an optional one it most likely meant.
        inner = _model_at(model, loc[:-1]) if model is not None and loc else None
        keys = _keys(inner) if inner is not None else []
        meant = meant or difflib.get_close_matches(str(loc[-1]), keys, n=1)
        expected = f"one of {', '.join(keys)}" if keys else "one of the documented keys"
        return field, "unknown key" + (f"; did you mean '{meant[0]}'?" if meant else ""), expected
    if kind in ("model_type", "model_attributes_type", "dict_type"):  # not pydantic's class names: what it is
        return field, f"not an object, got {shown}", "an object of named fields"
    if kind == "missing":
        return field, "missing", "a value"
    if kind == "value_error" and "error" in err.get("ctx", {}):
        return field, str(err["ctx"]["error"]), ""  # a check across fields: its own words, not the input's
    return field, f"{err.get('msg', 'invalid')}, got {shown}", ""


def _keys(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def _model_at(annotation: Any, loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model of the object at `loc` (a validation error's path) inside a value of type `annotation`: through
    fields, list items, mapping values and optional values; None where the path leaves models (a union of
    several kinds)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return _model_at(kinds[0], loc) if len(kinds) == 1 else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not loc:
            return annotation
        field = next((f for n, f in annotation.model_fields.items() if loc[0] in (n, f.alias)), None)
        return _model_at(field.annotation, loc[1:]) if field is not None else None
    if loc and origin is tuple and args and args[-1] is not Ellipsis:  # tuple[A, B]: position i is its own type
        index = loc[0]
        return _model_at(args[index], loc[1:]) if isinstance(index, int) and 0 <= index < len(args) else None
    if loc and origin in (list, tuple, set, frozenset) and args:
        return _model_at(args[0], loc[1:])
    if loc and origin is dict and len(args) == 2:
        return _model_at(args[1], loc[1:])
    return None


def load_model_file(model: type[M], path: str | Path, *, error: type[SchemaError] = SchemaError) -> M:
    """Reads a JSON file into `model`, naming the file and the field at fault on any error."""
    return validate_data(model, read_data(path, error=error), file=path, error=error)


def validate_data(
    model: type[M], data: Any, *, file: str | Path | None = None, error: type[InputError] = SchemaError
) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        field, message, expected = describe_validation_error(exc, model)
        raise error(message, file=file, field=field or None, expected=expected or None) from None


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(by_alias=True)
