"""Texts the quality measurements read. Nothing downloads: the evaluation and calibration texts are licence
texts Debian's `base-files` package ships in /usr/share/common-licenses (their licences allow verbatim
copies; kvrig only reads them), and the gate's short text is kvrig's own."""

from __future__ import annotations

from pathlib import Path

from kvrig.exceptions import QualityInputError

LICENSES = Path("/usr/share/common-licenses")
EVAL_FILES = ("GPL-3", "Apache-2.0")
"""Evaluation text: the GPL-3 text, then Apache-2.0 for contexts longer than the GPL-3 (~7.5k tokens)."""
CALIBRATION_FILES = ("GFDL-1.3", "GPL-2", "MPL-2.0", "LGPL-2.1")
"""Calibration text for AWQ / GPTQ / sensitivity recipes: other licences, never the evaluation text."""

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


def read_texts(names: tuple[str, ...], *, root: Path = LICENSES) -> tuple[str, list[str]]:
    """The named files joined by blank lines, and the paths read."""
    parts, used = [], []
    for name in names:
        path = root / name
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise QualityInputError(
                f"cannot read the text: {exc.strerror or exc}",
                file=path,
                expected="Debian's base-files licence texts (installed on every Debian system)",
            ) from None
        used.append(str(path))
    return "\n\n".join(parts), used


def tokens_of(tokenizer: object, text: str, n: int, *, what: str, source: str) -> list[int]:
    """The first `n` tokens of `text`, or a QualityInputError saying how many there are."""
    ids = list(tokenizer.encode(text))  # type: ignore[attr-defined]
    if len(ids) < n:
        raise QualityInputError(
            f"{what} has {len(ids)} tokens, fewer than the {n} asked for", file=source, expected=f">= {n} tokens"
        )
    return ids[:n]
