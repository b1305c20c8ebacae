"""`kvrig bench quality`'s weight and KV rows on the real SmolLM2: one perplexity per kind over passages spread
through the kind, equal to mlx-lm's own model (and its own quantized cache) reading the same passages (NLL summed
by hand here)."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import pytest

from tests.bundle_fixtures import converted_source

PASSAGES, TOKENS = 3, 64


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted_source(tmp_path_factory)


def mlx_lm_ppl(model: object, passages: list[list[int]], cache: list[object] | None = None) -> float:
    """exp of the mean NLL of every passage's tokens after its first: each passage read alone from no cache, or
    all of them side by side (one batch) from the empty caches `cache`."""
    nll = n = 0.0
    for ids in [passages] if cache is not None else [[p] for p in passages]:
        x = mx.array(ids)
        logits = model(x[:, :-1], cache=cache).astype(mx.float32)  # type: ignore[operator]
        target = x[:, 1:]
        picked = mx.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
        nll += (mx.logsumexp(logits, axis=-1) - picked).sum().item()
        n += target.size
    return math.exp(nll / n)


def test_weight_rows_measure_passages_spread_over_each_kind(source: Path) -> None:
    from mlx_lm.utils import load_model, load_tokenizer, quantize_model

    from kvrig.quality.bench import run_quality_bench
    from kvrig.texts import kind_segments

    report = run_quality_bench(
        source,
        recipes=("q4",),
        kv_variants=(),
        weights_tokens=TOKENS,
        weights_passages=PASSAGES,
        factual_recipe=None,
    )
    tokenizer = load_tokenizer(source)
    reference, config = load_model(source)
    reference.set_dtype(mx.float32)
    passages = {k: kind_segments(tokenizer, k, PASSAGES, TOKENS + 1) for k in report.text}
    assert len(report.text) == 2 and len(report.weights) == 2
    for kind, kind_passages in passages.items():
        expected = mlx_lm_ppl(reference, kind_passages)
        assert report.source_ppl[f"{kind}/{PASSAGES}x{TOKENS}"] == pytest.approx(expected, rel=2e-3)
        # the first passage alone is another number: the row is over all of them
        assert abs(mlx_lm_ppl(reference, kind_passages[:1]) / expected - 1) > 1e-2
    # q4 is mlx-lm's round-to-nearest at group 64: its own quantize_model gives the same perplexities
    quantize_model(reference, config, 64, 4)
    for row in report.weights:
        assert (row.recipe, row.passages, row.tokens) == ("q4", PASSAGES, TOKENS)
        expected = mlx_lm_ppl(reference, passages[row.kind])
        assert row.ppl == pytest.approx(expected, rel=2e-3)
        base = report.source_ppl[f"{row.kind}/{PASSAGES}x{TOKENS}"]
        assert row.ppl_delta_pct == pytest.approx(100 * (row.ppl / base - 1))


def test_kv_rows_measure_passages_spread_over_each_kind(source: Path) -> None:
    from mlx_lm.models.cache import QuantizedKVCache
    from mlx_lm.utils import load_model, load_tokenizer

    from kvrig.quality.bench import run_quality_bench
    from kvrig.texts import kind_segments

    report = run_quality_bench(
        source,
        recipes=(),
        kv_variants=("fp16", "k8v8"),
        kv_tokens=TOKENS,
        kv_passages=PASSAGES,
        contexts=(256,),
        decode_steps=1,
        factual_recipe=None,
    )
    tokenizer = load_tokenizer(source)
    reference, _ = load_model(source)
    reference.set_dtype(mx.float32)
    passages = {k: kind_segments(tokenizer, k, PASSAGES, TOKENS + 1) for k in report.text}
    # no weight rows: the source is measured on the KV rows' passages only
    assert report.weights == [] and set(report.source_ppl) == {f"{k}/{PASSAGES}x{TOKENS}" for k in passages}
    assert len(report.kv) == 2 * len(passages)
    layers = len(reference.layers)  # type: ignore[attr-defined]

    for row in report.kv:
        assert (row.recipe, row.passages, row.tokens) == ("source", PASSAGES, TOKENS)
        kind_passages = passages[row.kind]
        # k8v8 is mlx-lm's own 8-bit cache at group 64 and its quantized attention. Read side by side as the bench
        # reads them: a passage read alone differs in the last float bits of its keys, and a few of those cross
        # a rounding step, which moves perplexity by more than float rounding.
        quantized: list[object] = [QuantizedKVCache(group_size=64, bits=8) for _ in range(layers)]
        expected = mlx_lm_ppl(reference, kind_passages, quantized if row.kv == "k8v8" else None)
        assert row.ppl == pytest.approx(expected, rel=2e-3)
        base = report.source_ppl[f"{row.kind}/{PASSAGES}x{TOKENS}"]
        assert row.ppl_delta_pct == pytest.approx(100 * (row.ppl / base - 1))
        # the first passage alone is another number: the row is over all of them
        assert abs(mlx_lm_ppl(reference, kind_passages[:1]) / expected - 1) > 1e-2
    k8v8 = {r.kind: r.ppl for r in report.kv if r.kv == "k8v8"}
    assert all(k8v8[k] != report.source_ppl[f"{k}/{PASSAGES}x{TOKENS}"] for k in passages)


@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("quality", "--weights-tokens"),
        ("quality", "--weights-passages"),
        ("quality", "--kv-tokens"),
        ("quality", "--kv-passages"),
        ("quantize", "--tokens"),
        ("quantize", "--passages"),
    ],
)
def test_a_passage_of_no_tokens_is_refused_before_anything_loads(command: str, option: str) -> None:
    """Passages need a token to predict: 0 is click's usage error (exit 2) naming the option, not a traceback."""
    from click.testing import CliRunner

    from kvrig.cli import cli

    result = CliRunner().invoke(cli, ["bench", command, option, "0"])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}': 0 is not in the range x>=1" in result.output


def test_passages_longer_than_a_part_of_the_kind_are_refused_naming_the_files_and_the_way_out(tmp_path: Path) -> None:
    """Each passage is the tail of an equal part of the kind: one longer than its part is the input error (exit 46)
    naming the files read and that fewer passages draw on longer parts, before any model loads."""
    import subprocess
    import sys

    from kvrig.exceptions import QualityInputError
    from kvrig.texts import read_kind

    args = ["bench", "quality", "--recipes", "", "--kv", "fp16", "--kv-tokens", "100000", "--factual-recipe", ""]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kvrig", *args, "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == QualityInputError.exit_code == 46, proc.stderr
    assert ", ".join(read_kind("legal")[1]) in proc.stderr and "Traceback" not in proc.stderr
    assert "part 1 of 4 of the legal text (passage 1)" in proc.stderr
    assert "fewer than the 100001 asked for" in proc.stderr and "fewer passages draw on longer parts" in proc.stderr
    assert not out.exists()


def test_kv_rows_are_measured_against_the_unquantized_cache_wherever_it_was_listed() -> None:
    from kvrig.quality.bench import unquantized_first
    from kvrig.recipes import parse_kv

    names = lambda specs: [s.name for s in specs]  # noqa: E731
    assert names(unquantized_first([parse_kv("k8v4+rot"), parse_kv("fp16")])) == ["fp16", "k8v4+rot"]
    assert names(unquantized_first([parse_kv("k8v4"), parse_kv("k4v4")])) == ["fp16", "k8v4", "k4v4"]
    assert unquantized_first([]) == []


def test_a_goal_with_a_row_that_is_not_a_number_is_missed() -> None:
    """NaN compares false with everything: a worst-kind pick by `>` keeps the other kind and reads as met."""
    from kvrig.quality.bench import goals
    from kvrig.schemas.quality import QualityReport, Row

    nan = float("nan")
    common = {"ppl": 30.0}
    weights = [
        Row(recipe="gpx-4.6", kv="fp16", kind=kind, ppl_delta_pct=delta, tokens=512, bits_per_weight=4.5, **common)
        for kind, delta in (("legal", 1.0), ("quotes", nan))
    ]
    kv = [
        Row(recipe="source", kv="k8v4+rot", kind=kind, ppl_delta_pct=delta, tokens=1024, **common)
        for kind, delta in (("legal", 0.1), ("quotes", nan))
    ]
    report = QualityReport(model="m", text={"legal": [], "quotes": []}, calibration={}, weights=weights, kv=kv)
    judged = {g["goal"].split(" ")[2]: g for g in goals(report)}
    assert not judged["4.6"]["met"] and "nan" in judged["4.6"]["best"]
    assert not next(g for g in goals(report) if g["goal"].startswith("rotated k8v4"))["met"]


def test_a_run_judges_the_goals_of_what_it_measured() -> None:
    """A weights-only run (`--kv ''`) listed the KV goal as missed, and a KV-only run the weight goals: a goal
    nothing was measured for is not judged; one whose rows were measured and none qualifies is missed."""
    from kvrig.quality.bench import goals
    from kvrig.schemas.quality import QualityReport, Row

    weights = [Row(recipe="q8", kv="fp16", kind="legal", ppl=30.0, ppl_delta_pct=0.1, tokens=512, bits_per_weight=8.5)]
    kv = [Row(recipe="source", kv="k8v4", kind="legal", ppl=30.0, ppl_delta_pct=0.4, tokens=1024)]
    text = {"legal": []}
    only_weights = [g["goal"] for g in goals(QualityReport(model="m", text=text, calibration={}, weights=weights))]
    assert len(only_weights) == 2 and all(g.startswith("a <=") for g in only_weights)
    judged = goals(QualityReport(model="m", text=text, calibration={}, kv=kv))
    assert [g["goal"].split(" ")[0] for g in judged] == ["rotated"] and not judged[0]["met"]  # k8v4+rot not among them


def test_a_text_file_of_ones_own_is_a_kind_of_its_own(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--kinds legal,PATH`: the file is measured beside the licences, its source perplexity mlx-lm's own; the
    table names its column by the file's name, in line with the rows."""
    import email.message
    import inspect

    from mlx_lm.utils import load_model, load_tokenizer

    from kvrig.quality.bench import run_quality_bench
    from kvrig.texts import kind_segments

    mine = tmp_path / "mine.py"
    mine.write_text(inspect.getsource(email.message))
    report = run_quality_bench(
        source,
        recipes=("q8",),
        kv_variants=(),
        kinds=("legal", str(mine)),
        weights_tokens=TOKENS,
        weights_passages=PASSAGES,
        factual_recipe=None,
    )
    assert list(report.text) == ["legal", str(mine)] and report.text[str(mine)] == [str(mine)]
    assert {row.kind for row in report.weights} == {"legal", str(mine)}
    reference, _ = load_model(source)
    reference.set_dtype(mx.float32)
    passages = kind_segments(load_tokenizer(source), str(mine), PASSAGES, TOKENS + 1)
    expected = mlx_lm_ppl(reference, passages)
    assert report.source_ppl[f"{mine}/{PASSAGES}x{TOKENS}"] == pytest.approx(expected, rel=2e-3)

    from kvrig.cli.bench import _print_quality

    capsys.readouterr()
    _print_quality(report, [])
    lines = capsys.readouterr().out.splitlines()
    (head,) = [line for line in lines if line.startswith("recipe")]
    (row,) = [line for line in lines if line.startswith("q8 ")]
    assert head.split()[2:4] == ["legal", "mine.py"] and len(head) == len(row)
    assert head.index("mine.py") + len("mine.py") == row.index("%", head.index("legal") + len("legal")) + 1


@pytest.mark.parametrize("command", ["quality", "quantize"])
@pytest.mark.parametrize("kinds", ["legal,docs", "legal,no-such-kind"])
def test_calibration_text_or_a_misspelt_kind_is_refused_before_anything_loads(
    command: str, kinds: str, tmp_path: Path
) -> None:
    """Calibration text would judge calibrated recipes on what they learnt from: the input error (exit 46)
    naming --kinds, as for a kind that is neither a kind nor a file; in both benches."""
    import subprocess
    import sys

    from kvrig.exceptions import QualityInputError

    out = tmp_path / "out"
    more = ["--kv", "", "-o", str(out)] if command == "quality" else ["--no-scaling"]
    args = ["bench", command, "--kinds", kinds, "--recipes", "q8", *more]
    proc = subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == QualityInputError.exit_code, proc.stderr
    assert kinds.split(",")[1] in proc.stderr and "Traceback" not in proc.stderr
    assert "field '--kinds'" in proc.stderr and not out.exists()
