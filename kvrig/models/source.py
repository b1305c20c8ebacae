"""A model source in the Hugging Face layout, whatever it was given as: a folder is used as it is, a GGUF file is
converted into a scratch folder for as long as it is needed (removed on every way out; one a SIGKILLed run left
is removed by the next conversion beside it, see `fileio.scratch_dir`)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvrig.exceptions import ModelConfigError
from kvrig.fileio import check_json_files, read_data, scratch_dir, sha256_file
from kvrig.models.gguf import read_gguf_config
from kvrig.models.gguf_convert import convert_gguf
from kvrig.schemas.bundle import SourceModel

CONVERT_PREFIX = ".kvrig-convert-"


@contextlib.contextmanager
def source_dir(source: Path, *, scratch_parent: Path | None = None) -> Iterator[tuple[Path, SourceModel]]:
    """A Hugging Face-layout directory for `source` and what it was (a GGUF is converted into a scratch folder
    in `scratch_parent`, default the system's temporary folder, removed afterwards)."""
    if source.is_dir():
        check_json_files(source, error=ModelConfigError)  # the tokenizer's files are read by recursive parsers
        config = read_data(source / "config.json", error=ModelConfigError, mapping="a JSON object")
        yield (
            source,
            SourceModel(
                kind="hf",
                path=str(source.resolve()),
                name=str(config.get("_name_or_path") or source.name),
                architecture=str(config.get("model_type", "?")),
            ),
        )
        return
    config = read_gguf_config(source)  # fails fast on a non-GGUF file or an unknown architecture
    with scratch_dir(scratch_parent or Path(tempfile.gettempdir()), CONVERT_PREFIX) as scratch:
        convert_gguf(source, scratch)
        yield (
            scratch,
            SourceModel(
                kind="gguf",
                path=str(source.resolve()),
                name=source.name,
                sha256=sha256_file(source),
                architecture=config["model_type"],
            ),
        )
