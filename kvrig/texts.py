"""Texts the quality measurements read, by kind. Nothing downloads: every text is a file a Debian package ships,
except the gate's short prose, which is kvrig's own. What `kvrig package` reads (the calibration and gate kinds)
and the licence texts ship inside kvrig (kvrig/_texts, copied by scripts/vendor-texts.py; their licences allow
verbatim copies), so that every system reads the same bytes; the quotations are read from Debian's fortunes
package (`make setup` installs it), or where Homebrew puts fortune-mod's files.

Calibration (what AWQ, GPTQ and kvrig's importance-weighted recipes learn from) reads technical writing and code
(Python's tutorial, Python and C source); the quality bench judges recipes on kinds it never reads (licences,
quotations and dialogue). Calibrating on code and documentation measured better on every held-out kind than
calibrating on licences and quotations, in scratch runs. The package gate reads kvrig's own prose and files
calibration never reads (other Python modules, the Debian Reference).
"""

from __future__ import annotations

import functools
import glob
import gzip
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvrig.exceptions import QualityInputError

LICENSES = Path("/usr/share/common-licenses")
TEXTS_DIR = Path(__file__).resolve().parent / "_texts"
"""kvrig's copies of the shipped kinds' files, gzipped (SOURCES.json: each one's package, version and SHA-256)."""


@dataclass(frozen=True)
class TextKind:
    """One kind of text: where its files are, which Debian package ships them, and what it is used for."""

    name: str
    description: str
    package: str
    files: tuple[str, ...]
    """Paths (a glob where the Python version varies), read in this order."""
    role: Literal["calibration", "evaluation", "gate", "user"]
    """calibration: what calibrated recipes learn from; evaluation: kinds of text calibration never reads, where
    the quality bench judges recipes; gate: files calibration never reads (one of a calibration kind), where
    `kvrig package` checks a bundle beside kvrig's own prose; user: a file of the user's own (`user_kind`)."""
    start: str | None = None
    """The text starts at the first occurrence of this (a manual's table of contents is not prose)."""
    shipped: bool = False
    """Read from kvrig's copies of `files` (`vendored`), not from the Debian package."""
    elsewhere: tuple[str, ...] = ()
    """Folders that hold the same files on systems without the Debian package, tried in order when it is missing."""

    @property
    def vendored(self) -> tuple[str, ...]:
        """The copies' names under TEXTS_DIR, one per file: `<kind>/<file name>.gz`."""
        if not self.shipped:
            return ()
        return tuple(f"{self.name}/{Path(p).name.removesuffix('.gz')}.gz" for p in self.files)


_PY_MODULES = ("textwrap", "difflib", "fractions", "shlex", "calendar", "heapq", "statistics", "argparse")
_PY_HELD_OUT = ("csv", "configparser", "pprint", "tokenize", "zipfile", "json/decoder")
_TUTORIAL = ("introduction", "controlflow", "datastructures", "modules", "inputoutput", "errors", "classes", "stdlib")

KINDS: tuple[TextKind, ...] = (
    TextKind(
        "docs",
        "technical documentation: Python's tutorial",
        "python3-doc",
        tuple(f"/usr/share/doc/python3.*/html/_sources/tutorial/{name}.rst.txt" for name in _TUTORIAL),
        "calibration",
        shipped=True,
    ),
    TextKind(
        "python",
        "Python source: modules of the standard library",
        "libpython3-stdlib",
        tuple(f"/usr/lib/python3.*/{name}.py" for name in _PY_MODULES),
        "calibration",
        shipped=True,
    ),
    TextKind(
        "c",
        "C headers of the GNU C library",
        "libc6-dev",
        tuple(f"/usr/include/{name}.h" for name in ("stdio", "stdlib", "string", "unistd", "pthread", "signal")),
        "calibration",
        shipped=True,
    ),
    TextKind(
        "legal",
        "licence texts",
        "base-files",
        tuple(str(LICENSES / name) for name in ("GPL-3", "Apache-2.0", "GFDL-1.3", "MPL-2.0")),
        "evaluation",
        shipped=True,  # each licence allows verbatim copies: the benches read the same text on a Mac
    ),
    TextKind(
        "quotes",
        "quotations, jokes and dialogue (fortune cookies)",
        "fortunes",
        tuple(
            f"/usr/share/games/fortunes/{name}"
            for name in ("literature", "wisdom", "people", "startrek", "men-women", "humorists", "work", "science")
        ),
        "evaluation",
        # fortune-mod's files where Homebrew puts them (`brew install fortune`): not Debian's release of them
        elsewhere=("/opt/homebrew/share/games/fortunes", "/usr/local/share/games/fortunes"),
    ),
    TextKind(
        "python-held-out",
        "Python source the calibration never reads: other modules of the standard library",
        "libpython3-stdlib",
        tuple(f"/usr/lib/python3.*/{name}.py" for name in _PY_HELD_OUT),
        "gate",
        shipped=True,
    ),
    TextKind(
        "manual",
        "technical documentation of another project: the Debian Reference",
        "debian-reference-en",
        ("/usr/share/debian-reference/debian-reference.en.txt.gz",),
        "gate",
        start="This Debian Reference (version",
        shipped=True,
    ),
)
CALIBRATION_KINDS = tuple(k.name for k in KINDS if k.role == "calibration")
EVALUATION_KINDS = tuple(k.name for k in KINDS if k.role == "evaluation")
GATE_KINDS = tuple(k.name for k in KINDS if k.role == "gate")

GATE_TEXT = """\
The river town woke slowly on market days. Before the sun had cleared the hills, farmers were already
unloading crates of apples, onions and late summer pears, and the baker on the corner had sold his first
batch of bread to the men who worked the early shift at the mill. By eight o'clock the square was full.
Children ran between the stalls while their parents argued cheerfully about the price of cheese, and an old
man with a violin played the same three songs he had played for forty years.

Most people in the town had never travelled further than the capital, a day's journey by train. They knew
the names of the mountains to the north and the ports to the south from their school lessons, and they knew
that the river, which looked so calm from the bridge, had flooded the lower streets twice in living memory.
The council had built a stone wall after the second flood. It was tested every spring, and every spring it
held, and every spring the newspaper printed the same photograph of the mayor standing on top of it.

In the afternoon the market packed up as quickly as it had appeared. The farmers drove home, the square was
swept, and the café tables came back out for the evening. Teachers marked homework, nurses changed shifts
at the small hospital by the station, and in the library a volunteer sorted the books that visitors had
returned late, stamping each one with the date before putting it back on its shelf.
"""


def kind(name: str, field: str = "kind") -> TextKind:
    """A kind of text by name, or a file of the user's own by its path (`user_kind`); `field` names where it
    was asked for."""
    for k in KINDS:
        if k.name == name:
            return k
    if Path(name).is_file():
        return user_kind(name)
    raise QualityInputError(
        f"no text kind {name!r} and no file of that name",
        field=field,
        expected=f"one of {', '.join(k.name for k in KINDS)}, or the path of a text file",
    )


def user_kind(path: str | Path) -> TextKind:
    """A text file of the user's own (UTF-8; `.gz` is read as gzip) as a kind of its own, named by the path as
    given: what an app will read is the text its quality is best measured on."""
    name = str(path)
    if any(k.name == name for k in KINDS):  # a file named like a kind is the file, in the records too
        name = f"./{name}"
    return TextKind(name, f"your text: {path}", "", (str(path),), "user")


def column_label(name: str) -> str:
    """A kind's name for a table's column: a file of the user's own by its file name (the full path is listed
    beside the table)."""
    short = Path(name).name
    return short if short and short not in {k.name for k in KINDS} else name


def evaluation_kind(name: str, option: str) -> TextKind:
    """A kind a measurement may judge a recipe on: any but the calibration's, which would read better than it
    is, nor a file holding a passage of it (`option` names where it was asked for)."""
    found = kind(name, option)
    if found.role == "user":
        read_kind(found)  # before anything loads: a file that is no text, or holds calibration text
    if found.role == "calibration":
        raise QualityInputError(
            f"{name!r} is calibration text: calibrated recipes learn from it, so it cannot judge them",
            field=option,
            expected=f"a kind calibration never reads ({', '.join(k.name for k in KINDS if k.role != 'calibration')})"
            " or a text file of your own",
        )
    return found


def debian_path(pattern: str) -> Path:
    """The file a pattern of `TextKind.files` names: of several Pythons installed, the newest's."""
    matches = sorted(glob.glob(pattern)) if "*" in pattern else [pattern]
    return Path(matches[-1]) if matches else Path(pattern)


def _found(text_kind: TextKind, path: Path) -> Path:
    """`path`, or the first of the kind's other folders holding its file when it is missing (else `path`)."""
    if path.exists():
        return path
    return next((Path(f) / path.name for f in text_kind.elsewhere if (Path(f) / path.name).exists()), path)


def read_kind(text_kind: TextKind | str) -> tuple[str, list[str]]:
    """The kind's files joined by blank lines, and the paths read."""
    text_kind = kind(text_kind) if isinstance(text_kind, str) else text_kind
    parts, used = [], []
    if text_kind.shipped:
        paths = [TEXTS_DIR / name for name in text_kind.vendored]
        expected = "kvrig's copy of it (kvrig/_texts: reinstall kvrig)"
    elif text_kind.role == "user":
        paths = [Path(p) for p in text_kind.files]
        expected = "a readable text file (UTF-8; .gz read as gzip)"
    else:
        paths = [_found(text_kind, debian_path(pattern)) for pattern in text_kind.files]
        expected = f"Debian's {text_kind.package} package (`make setup` installs it)"
        if text_kind.elsewhere:
            expected += f", or the same files in {' or '.join(text_kind.elsewhere)}"
    user = text_kind.role == "user"
    for path in paths:
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            # A user's file is read as it is, strictly: a binary file measured as replacement characters would
            # judge recipes on noise. Fortune files separate their entries by "%" lines.
            text = raw.decode("utf-8", errors="strict" if user else "replace")
            parts.append(text if user else text.replace("\n%\n", "\n\n"))
        except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as exc:
            problem = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise QualityInputError(
                f"cannot read the {text_kind.name} text: {problem}", file=path, expected=expected
            ) from None
        if user and (copied := calibration_passage(text)) is not None:
            raise QualityInputError(
                f"this file holds a passage of calibration text ({copied}): calibrated recipes learn from it, so it "
                "cannot judge them",
                file=path,
                expected="text calibration never reads",
            )
        used.append(str(path))
    text = "\n\n".join(parts)
    if text_kind.start is not None and text_kind.start in text:
        text = text[text.index(text_kind.start) :]
    return text, used


COPIED_LINES = 12
"""Consecutive lines of a user's file (of MIN_LINE characters or more, shorter ones skipped) that, following one
another in a calibration file too, make the file a copy of calibration text: far fewer than a 256-token passage
holds, far more than two texts of one language share by chance."""
MIN_LINE = 24
"""Characters a line needs to count: shorter ones (`}`, `return result`) are in any code."""


def calibration_passage(text: str) -> str | None:
    """The calibration file a passage of `text` was copied from (COPIED_LINES lines in a row, compared without
    their indentation), or None."""
    lines = _long_lines(text)
    run = 0
    for pair in itertools.pairwise(lines):
        run = run + 1 if pair in _calibration_pairs() else 0
        if run + 1 >= COPIED_LINES:
            return _calibration_pairs()[pair]
    return None


def _long_lines(text: str) -> list[str]:
    return [line for line in map(str.strip, text.splitlines()) if len(line) >= MIN_LINE]


@functools.cache
def _calibration_pairs() -> dict[tuple[str, str], str]:
    """Every two long lines that follow one another in one calibration file and in no other, with that file's
    name."""
    files: dict[tuple[str, str], set[str]] = {}
    for name in CALIBRATION_KINDS:
        for vendored in kind(name).vendored:
            lines = _long_lines(gzip.decompress((TEXTS_DIR / vendored).read_bytes()).decode("utf-8", "replace"))
            for pair in itertools.pairwise(lines):
                files.setdefault(pair, set()).add(vendored)
    # What two calibration files share (glibc's licence header, in every header) is boilerplate, not their text.
    return {pair: next(iter(names)) for pair, names in files.items() if len(names) == 1}


def tokens_of(tokenizer: object, text: str, n: int, *, what: str, source: str) -> list[int]:
    """The first `n` tokens of `text`, or a QualityInputError saying how many there are. Encodes a prefix that
    grows until it holds them (a whole manual is ~100k tokens; the tokenizer warns past the model's length)."""
    chars = 8 * n
    while True:
        ids = list(tokenizer.encode(text[:chars]))  # type: ignore[attr-defined]
        if len(ids) > n or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise QualityInputError(
            f"{what} has {len(ids)} tokens, fewer than the {n} asked for", file=source, expected=f">= {n} tokens"
        )
    return ids[:n]


def kind_tokens(tokenizer: object, name: str, n: int) -> list[int]:
    """The first `n` tokens of one kind of text."""
    text, used = read_kind(name)
    return tokens_of(tokenizer, text, n, what=f"the {name} text", source=", ".join(used))


def kind_segments(tokenizer: object, name: TextKind | str, segments: int, n: int) -> list[list[int]]:
    """`segments` runs of `n` tokens spread over one kind of text: the last `n` tokens of each of `segments`
    equal parts: one short passage is a noisy sample of a kind. The package gate and both quality benches read
    these."""
    text, used = read_kind(name)
    label = name if isinstance(name, str) else name.name
    source = ", ".join(used)
    size = len(text) // segments
    # a part too short names the way out: fewer passages draw on longer parts
    expected = f">= {n} tokens in each of {segments} equal parts of the text"
    expected += "; fewer passages draw on longer parts" if segments > 1 else ""
    return [
        _tail_tokens(
            tokenizer,
            text[: (i + 1) * size],
            n,
            what=f"part {i + 1} of {segments} of the {label} text (passage {i + 1})",
            source=source,
            expected=expected,
        )
        for i in range(segments)
    ]


def _tail_tokens(
    tokenizer: object, text: str, n: int, *, what: str, source: str, expected: str | None = None
) -> list[int]:
    """The last `n` tokens of `text`, encoded from a line start."""
    chars = 8 * n
    while True:
        tail = text[-chars:]
        ids = list(tokenizer.encode(tail[tail.find("\n") + 1 :]))  # type: ignore[attr-defined]
        if len(ids) >= n or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise QualityInputError(
            f"{what} has {len(ids)} tokens, fewer than the {n} asked for", file=source, expected=expected or f">= {n}"
        )
    return ids[-n:]
