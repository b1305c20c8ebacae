"""The texts quality is measured on: every kind readable (kvrig's own copies for what `kvrig package` reads, the
Debian packages for the benches' evaluation kinds), the copies faithful to their packages, calibration and evaluation
never sharing a kind, and the calibration rows drawn from every calibration kind in turn."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from kvrig.exceptions import QualityInputError
from kvrig.quantize.recipes import calibration_files, calibration_tokens
from kvrig.texts import (
    CALIBRATION_KINDS,
    EVALUATION_KINDS,
    GATE_KINDS,
    KINDS,
    TEXTS_DIR,
    TextKind,
    debian_path,
    kind_tokens,
    read_kind,
)

SOURCES = json.loads((TEXTS_DIR / "SOURCES.json").read_text())


@pytest.mark.parametrize("kind", [k.name for k in KINDS])
def test_every_kind_reads_enough_text(kind: str) -> None:
    text, used = read_kind(kind)
    assert used and len(text) > 20_000, (kind, len(text))
    assert "\ufffd" not in text[:20_000]  # decoded as the UTF-8 it is


def test_calibration_shares_no_kind_with_evaluation_and_no_file_with_anything() -> None:
    assert CALIBRATION_KINDS and EVALUATION_KINDS and GATE_KINDS
    assert not set(CALIBRATION_KINDS) & (set(EVALUATION_KINDS) | set(GATE_KINDS))
    calibration = {f for k in CALIBRATION_KINDS for f in read_kind(k)[1]}
    measured = {f for k in EVALUATION_KINDS + GATE_KINDS for f in read_kind(k)[1]}
    assert not calibration & measured


def test_the_manual_starts_at_its_prose_not_its_table_of_contents() -> None:
    text, _ = read_kind("manual")
    assert text.startswith("This Debian Reference (version")


def test_calibration_rows_take_every_calibration_kind_in_turn(source_tokenizer: object) -> None:
    rows = calibration_tokens(source_tokenizer, samples=6, length=64)
    assert rows.shape == (6, 64)
    for i, kind in enumerate(CALIBRATION_KINDS * 2):
        expected = kind_tokens(source_tokenizer, kind, 2 * 64)[(i // len(CALIBRATION_KINDS)) * 64 :][:64]
        assert rows[i].tolist() == expected, (i, kind)
    assert set(calibration_files()) == set(CALIBRATION_KINDS)


def test_a_missing_package_names_it(tmp_path: object) -> None:
    missing = TextKind("gone", "a text", "some-package", ("/nonexistent/file.txt",), "evaluation")
    with pytest.raises(QualityInputError, match="some-package") as raised:
        read_kind(missing)
    assert raised.value.exit_code == 46


@pytest.fixture(scope="module")
def source_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    from tests.bundle_fixtures import converted_source

    return load_tokenizer(converted_source(tmp_path_factory))


@pytest.mark.parametrize("kind", GATE_KINDS)
def test_gate_passages_are_spread_over_the_kind(source_tokenizer: object, kind: str) -> None:
    """Each passage is the tail of its own quarter of the text: four different places, each decoding to text
    that is in the kind's files (read here directly), none of them the same passage twice."""
    from kvrig.quality.gate import GATE_SEGMENTS, SEGMENT_TOKENS
    from kvrig.texts import kind_segments

    text, _ = read_kind(kind)
    passages = kind_segments(source_tokenizer, kind, GATE_SEGMENTS, SEGMENT_TOKENS)
    assert len(passages) == GATE_SEGMENTS and all(len(p) == SEGMENT_TOKENS for p in passages)
    decoded = [source_tokenizer.decode(p[8:-8]) for p in passages]  # type: ignore[attr-defined]  # whole tokens
    where = [text.find(d) for d in decoded]
    assert all(w >= 0 for w in where), where
    quarter = len(text) // GATE_SEGMENTS
    assert [w // quarter for w in where] == list(range(GATE_SEGMENTS))


def test_what_package_reads_ships_with_kvrig() -> None:
    """Calibration and the gate read only kvrig's copies (macOS has none of the Debian packages), each one the
    bytes SOURCES.json recorded when it was copied; nothing else is in the folder unrecorded."""
    shipped = [k for k in KINDS if k.role in ("calibration", "gate")]
    assert shipped and all(k.shipped for k in shipped)
    for text_kind in shipped:
        _, used = read_kind(text_kind)
        assert all(Path(u).is_relative_to(TEXTS_DIR) for u in used), used
        for name in text_kind.vendored:
            text = gzip.decompress((TEXTS_DIR / name).read_bytes())
            assert hashlib.sha256(text).hexdigest() == SOURCES[name]["sha256"], name
    copies = {p.relative_to(TEXTS_DIR).as_posix() for p in TEXTS_DIR.rglob("*.gz")}
    assert copies == set(SOURCES) == {n for k in KINDS for n in k.vendored}


def _installed(package: str) -> str | None:
    if shutil.which("dpkg-query") is None:
        return None
    done = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_copy_is_its_debian_file(name: str) -> None:
    """The copy against the file of the installed package it was copied from, where that version is installed
    (an update of the package may change the file; scripts/vendor-texts.py copies it again)."""
    source = SOURCES[name]
    installed = _installed(source["package"])
    if installed != source["version"]:
        pytest.skip(f"{source['package']} {source['version']} is not installed here (found: {installed})")
    text_kind = next(k for k in KINDS if name in k.vendored)
    origin = debian_path(text_kind.files[text_kind.vendored.index(name)])
    assert str(origin) == source["path"]
    raw = origin.read_bytes()
    assert gzip.decompress((TEXTS_DIR / name).read_bytes()) == (gzip.decompress(raw) if origin.suffix == ".gz" else raw)


def test_a_damaged_copy_names_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import kvrig.texts

    shutil.copytree(TEXTS_DIR, tmp_path / "_texts")
    damaged = tmp_path / "_texts" / next(k for k in KINDS if k.name == "docs").vendored[0]
    damaged.write_bytes(damaged.read_bytes()[:100])
    monkeypatch.setattr(kvrig.texts, "TEXTS_DIR", tmp_path / "_texts")
    with pytest.raises(QualityInputError, match="cannot read the docs text") as raised:
        read_kind("docs")
    assert raised.value.exit_code == 46 and raised.value.file == str(damaged)
    assert "reinstall kvrig" in str(raised.value)


def test_a_kind_missing_from_debian_is_read_where_other_systems_put_it(tmp_path: Path) -> None:
    """fortune-mod's files where Homebrew puts them, for a Mac without Debian's package; missing everywhere, the
    message names both places."""
    elsewhere = tmp_path / "share" / "games" / "fortunes"
    elsewhere.mkdir(parents=True)
    (elsewhere / "wisdom").write_text("A fortune.\n%\nAnother.\n")
    quotes = TextKind(
        "q",
        "quotes",
        "fortunes",
        ("/nonexistent/fortunes/wisdom",),
        "evaluation",
        elsewhere=(str(tmp_path / "nowhere"), str(elsewhere)),
    )
    text, used = read_kind(quotes)
    assert used == [str(elsewhere / "wisdom")] and text == "A fortune.\n\nAnother.\n"
    (elsewhere / "wisdom").unlink()
    with pytest.raises(QualityInputError, match="fortunes") as raised:
        read_kind(quotes)
    assert str(elsewhere) in str(raised.value) and raised.value.file == "/nonexistent/fortunes/wisdom"


def test_a_users_file_is_read_as_it_is_and_never_as_a_kind_of_the_same_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvrig.exceptions import QualityInputError
    from kvrig.texts import kind, read_kind, user_kind

    mine = tmp_path / "notes.txt"
    mine.write_text("one\n%\ntwo\n", encoding="utf-8")
    assert kind(str(mine)).role == "user" and kind(str(mine)).name == str(mine)
    assert read_kind(str(mine)) == ("one\n%\ntwo\n", [str(mine)])  # no fortune-file separators dropped
    monkeypatch.chdir(tmp_path)
    Path("legal").write_text("mine")
    assert kind("legal").role == "evaluation"  # the name is the kind's
    assert user_kind("legal").name == "./legal" and read_kind(user_kind("legal"))[0] == "mine"
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(QualityInputError) as caught:
        read_kind(str(latin1))
    assert caught.value.file == str(latin1) and "UTF-8" in str(caught.value)


def _lines_of(vendored: str) -> list[str]:
    return gzip.decompress((TEXTS_DIR / vendored).read_bytes()).decode().splitlines()


@pytest.mark.parametrize("kind_name", CALIBRATION_KINDS)
def test_a_users_file_holding_calibration_text_is_refused(kind_name: str, tmp_path: Path) -> None:
    """A passage copied out of the middle of any calibration file, re-indented, amid text of one's own: the file
    cannot judge calibrated recipes, at the bench's --kinds as where it is read."""
    from kvrig.texts import evaluation_kind, kind

    for vendored in kind(kind_name).vendored:
        lines = _lines_of(vendored)
        middle = len(lines) // 2
        passage = ["\t" + line.strip() for line in lines[middle : middle + 120]]
        mine = tmp_path / f"{Path(vendored).stem}.txt"
        mine.write_text("My own notes on this.\n" * 3 + "\n".join(passage) + "\nThe end of my notes.\n")
        with pytest.raises(QualityInputError) as caught:
            evaluation_kind(str(mine), "--kinds")
        assert caught.value.file == str(mine) and vendored in str(caught.value)


def test_text_calibration_never_reads_is_not_taken_for_it(tmp_path: Path) -> None:
    """What the gate and the evaluation read (shipped copies of Debian files calibration never reads), and what
    two calibration files share (glibc's licence header) beside text of one's own, are files one may judge by."""
    from kvrig.texts import evaluation_kind, kind

    shipped = [v for k in KINDS if k.role != "calibration" and k.shipped for v in k.vendored]
    assert shipped
    for vendored in shipped:
        mine = tmp_path / Path(vendored).name.removesuffix(".gz")
        mine.write_text("\n".join(_lines_of(vendored)))
        assert evaluation_kind(str(mine), "--kinds").role == "user"
    c_files = kind("c").vendored
    shared = [line for line in _lines_of(c_files[0]) if line in set(_lines_of(c_files[1])) and len(line.strip()) > 30]
    assert len(shared) >= 12  # the licence header every glibc header carries
    mine = tmp_path / "mine.h"
    mine.write_text("\n".join(shared) + "\nint my_own_function(int argument, const char *name);\n")
    assert evaluation_kind(str(mine), "--kinds").role == "user"
