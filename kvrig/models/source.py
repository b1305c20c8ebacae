"""A model source in the Hugging Face layout, whatever it was given as: a folder is used as it is, a GGUF file is
converted into a scratch folder for as long as it is needed (removed on every way out; one a SIGKILLed run left
is removed by the next conversion beside it, see `fileio.scratch_dir`)."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def read_tokenizer(folder: Path, *, eos_token_ids: Any = None) -> Any:
    """mlx-lm's tokenizer for a Hugging Face-layout folder, or ModelConfigError naming its file when mlx-lm (or
    the tokenizers library under it) cannot load it: a file cut short, edited, or not a tokenizer."""
    from mlx_lm.utils import load_tokenizer

    check_json_files(folder, error=ModelConfigError)  # the tokenizers library parses recursively
    try:
        return load_tokenizer(folder, eos_token_ids=eos_token_ids)
    except Exception as exc:  # the tokenizers library raises bare Exception for a file it cannot parse
        file, why = _tokenizer_fault(folder, exc)
        bundle = " (a bundle: `kvrig verify` names every file that differs from its manifest)"
        raise ModelConfigError(
            f"mlx-lm cannot load the tokenizer ({why}){bundle if (folder / 'manifest.json').is_file() else ''}",
            file=file,
            expected="the model's tokenizer files as Hugging Face writes them",
        ) from None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
)
"""The JSON files mlx-lm's tokenizer loading reads from a Hugging Face folder, where present."""


def _tokenizer_fault(folder: Path, exc: Exception) -> tuple[Path, str]:
    """(the file at fault, why) for a tokenizer mlx-lm could not load: the first of its JSON files that does not
    parse (a JSON error says only where, not in which file), else tokenizer.json with mlx-lm's own reason."""
    for name in TOKENIZER_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_text(encoding="utf-8"))  # as transformers reads them: a byte-order mark is an error
        except (OSError, ValueError) as bad:
            return path, f"{type(bad).__name__}: {bad}"
    file = folder / "tokenizer.json" if (folder / "tokenizer.json").exists() else folder
    return file, f"{type(exc).__name__}: {exc}"
