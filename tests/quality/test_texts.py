"""The texts quality is measured on: every kind readable from the Debian package that ships it, calibration and
evaluation never sharing a kind, and the calibration rows drawn from every calibration kind in turn."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from kvrig.exceptions import QualityInputError
from kvrig.quantize.recipes import calibration_files, calibration_tokens
from kvrig.texts import (
    CALIBRATION_KINDS,
    EVALUATION_KINDS,
    GATE_KINDS,
    KINDS,
    TextKind,
    kind_tokens,
    read_kind,
)


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
