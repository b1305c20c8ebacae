"""Reading the JSON and YAML files kvrig is given, and writing the files it keeps current, in one place each.

Every read failure (missing, unreadable, not UTF-8, not parseable, nested beyond reason, not the mapping asked
for) raises the caller's InputError subclass naming the file; writes go through a temporary file so a reader
never sees half a file, and a write that fails (disk full) raises OutputWriteError and leaves the file as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import yaml

from kvrig.exceptions import InputError, OutputWriteError

# libyaml is ~10x faster when present
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YAML_LOADER)


def read_data(
    path: str | Path,
    *,
    error: type[InputError] = InputError,
    kind: Literal["json", "yaml"] = "json",
    mapping: str | None = None,
    expected: str | None = None,
) -> Any:
    """The parsed contents of a JSON or YAML file. With `mapping` (what the mapping should be, for the message),
    anything but a mapping is refused; `expected` is added to every message."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise error("file not found", file=path, expected=expected) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read: {exc}", file=path, expected=expected) from None
    try:
        data = json.loads(text) if kind == "json" else parse_yaml(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise error(f"not valid {kind.upper()}: {exc}", file=path, expected=expected) from None
    except RecursionError:
        raise error(f"not valid {kind.upper()}: nested too deeply to read", file=path, expected=expected) from None
    if mapping is not None and not isinstance(data, dict):
        raise error(f"not a {kind.upper()} mapping", file=path, expected=mapping)
    return data


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """A hidden temporary beside `path` to write, renamed over `path` when the block ends well and removed when it
    does not; a write that fails (disk full, not writable) is OutputWriteError and `path` stays as it was."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise OutputWriteError(f"{path}: cannot write: {exc.strerror or exc}") from None
        raise


def atomic_write(path: Path, data: str | bytes) -> None:
    """Replaces `path` whole: the new contents go to a hidden temporary beside it, then are renamed over it."""
    with atomic_output(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB pieces (bundles hold files of gigabytes)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
