"""The measurement cache: what a package measured on a source is read back by the next package of that source and
equals a fresh measurement; anything its numbers depend on makes a new key; a broken entry is measured again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrig.bundle.options import PackageOptions
from kvrig.packaging import package
from kvrig.quality.measured import CACHE_ENV, Entry, Measurements, source_digest
from tests.bundle_fixtures import converted_source, tiny_source

IDS = {"prose": [[1, 2, 3]], "manual": [[4, 5, 6], [7, 8]]}


class Counter:
    def __init__(self, values: dict[str, float]) -> None:
        self.values, self.calls = values, 0

    def __call__(self) -> dict[str, float]:
        self.calls += 1
        return dict(self.values)


def test_a_second_read_is_served_and_any_key_part_changes_it(tmp_path: Path) -> None:
    cache = Measurements(tmp_path, "source-a")
    first = Counter({"prose": 10.5, "manual": 20.25})
    assert cache.perplexities({"measured": "x"}, IDS, first) == ({"prose": 10.5, "manual": 20.25}, False)
    assert cache.perplexities({"measured": "x"}, IDS, first) == ({"prose": 10.5, "manual": 20.25}, True)
    assert first.calls == 1
    other = Counter({"prose": 1.0, "manual": 2.0})
    for changed, what, ids in (
        (Measurements(tmp_path, "source-b"), {"measured": "x"}, IDS),
        (cache, {"measured": "y"}, IDS),
        (cache, {"measured": "x"}, {**IDS, "prose": [[1, 2, 4]]}),
    ):
        assert changed.perplexities(what, ids, other)[1] is False
    assert other.calls == 3


def test_a_broken_entry_is_measured_again_and_replaced(tmp_path: Path) -> None:
    cache = Measurements(tmp_path, "source-a")
    cache.perplexities({"measured": "x"}, IDS, Counter({"prose": 1.0, "manual": 2.0}))
    (entry,) = tmp_path.rglob("*.json")
    for broken in (b"{not json", json.dumps({"schema_version": 1, "what": {}, "perplexity": {}, "extra": 1}).encode()):
        entry.write_bytes(broken)
        again = Counter({"prose": 1.0, "manual": 2.0})
        assert cache.perplexities({"measured": "x"}, IDS, again) == ({"prose": 1.0, "manual": 2.0}, False)
        assert again.calls == 1 and Entry.model_validate_json(entry.read_bytes()).perplexity == again.values


def test_off_measures_every_time_and_keeps_nothing(tmp_path: Path) -> None:
    cache = Measurements(None, "source-a")
    counter = Counter({"prose": 1.0, "manual": 2.0})
    for _ in range(2):
        assert cache.perplexities({"measured": "x"}, IDS, counter)[1] is False
    assert counter.calls == 2


def test_an_unwritable_folder_costs_a_measurement_not_the_result(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = Measurements(blocker / "cache", "source-a")  # a folder under a file cannot be made
    assert cache.perplexities({"measured": "x"}, IDS, Counter({"prose": 1.0, "manual": 2.0}))[0] == {
        "prose": 1.0,
        "manual": 2.0,
    }


def test_a_folder_sources_digest_follows_its_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"a")
    before = source_digest(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"b")
    assert source_digest(tmp_path) != before


def test_the_next_package_reads_what_the_first_measured(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packages of one tiny source (SmolLM2's tokenizer, so the gate reads real text): the next reads the source's
    perplexities and `--kv auto`'s from the cache, a bundle of other weights is measured, the same bundle again is
    read (its gate too), also when only its plan differs (kvcache.json's prefill step and context), and all of it
    equals what `--no-cache` measures afresh."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    tokenizer = converted_source(tmp_path_factory) / "tokenizer.json"
    tiny = tiny_source(tmp_path / "tiny", tokenizer, "llama", vocab_size=49152, head_dim=64)

    def run(name: str, **options: object) -> tuple[list[str], dict[str, float], dict[str, float | None], list[float]]:
        said: list[str] = []
        opts = PackageOptions(weights="q8", kv="auto", ignore_gate=True, progress=said.append, **options)  # type: ignore[arg-type]
        manifest = package(tiny, tmp_path / name, opts).manifest
        assert manifest.quality is not None and manifest.choice is not None
        return (
            said,
            {k.kind: k.source_ppl for k in manifest.quality.kinds},
            {c.kv: c.ppl_delta_pct for c in manifest.choice.kv},
            [k.bundle_ppl for k in manifest.quality.kinds],
        )

    said, source_ppl, kv_delta, bundle_ppl = run("first")
    assert "measuring the unquantized model on the gate's texts ..." in said
    assert "measuring the q8 bundle on the gate's texts ..." in said
    assert not [line for line in said if "measured before" in line]
    said_other, source_other, kv_other, _ = run("other-weights", group_size=32)
    measuring = [line for line in said_other if line.startswith("measuring")]
    assert measuring == ["measuring the q8g32 bundle on the gate's texts ..."]
    assert len([line for line in said_other if "measured before" in line]) == 3  # the source, k8v4, k8v4+rot
    said_again, source_again, kv_again, bundle_again = run("again")
    assert not [line for line in said_again if line.startswith("measuring")]
    assert "the q8 bundle on the gate's texts: measured before" in " ".join(said_again)
    said_plan, _, _, bundle_plan = run("other-plan", prefill_step_size=128, max_context=1024)
    kvcache = [json.loads((tmp_path / name / "kvcache.json").read_text()) for name in ("first", "other-plan")]
    assert [(k["prefill_step_size"], k["max_context"]) for k in kvcache] != [(128, 1024)] * 2
    assert not [line for line in said_plan if line.startswith("measuring")] and bundle_plan == bundle_ppl
    fresh_said, fresh, kv_fresh, bundle_fresh = run("fresh", cache=False)
    assert "measuring the unquantized model on the gate's texts ..." in fresh_said
    assert source_other == source_again == source_ppl == fresh and kv_other == kv_again == kv_delta == kv_fresh
    assert bundle_again == bundle_ppl == bundle_fresh
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 5  # the source, two KV specs, two bundles


def test_packages_measuring_at_once_measure_once(tmp_path: Path) -> None:
    """Two packages of one source at once: the second waits for the first's measurement and reads it."""
    import threading
    import time

    calls: list[int] = []

    def slow() -> dict[str, float]:
        calls.append(1)
        time.sleep(0.3)
        return {"prose": 1.5, "manual": 2.5}

    got: list[tuple[dict[str, float], bool]] = []
    runs = [
        threading.Thread(target=lambda: got.append(Measurements(tmp_path, "source-a").perplexities({}, IDS, slow)))
        for _ in range(2)
    ]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert len(calls) == 1
    assert sorted(cached for _, cached in got) == [False, True] and got[0][0] == got[1][0] == {
        "prose": 1.5,
        "manual": 2.5,
    }
