"""`kvrig demo` end to end (slow: packages, soaks SmolLM2 on a virtual iPhone until jetsam)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrig.demo import DemoOptions, run_demo


@pytest.mark.slow
def test_demo_soaks_into_jetsam(tmp_path: Path) -> None:
    result = run_demo(DemoOptions(out=tmp_path, room_tokens=768, decode_tokens=1))
    soak = result.soak
    assert soak.outcome == "jetsam", soak.outcome_detail
    assert soak.footprint_at_kill_bytes is not None and soak.footprint_at_kill_bytes >= result.limit_bytes
    assert soak.max_safe_context is not None and soak.max_safe_context > 0
    assert soak.predicted is not None and soak.predicted.limit_bytes == result.limit_bytes
    saved = json.loads((result.soak_dir / "results.json").read_text())
    assert saved["runs"][0]["outcome"] == "jetsam"
    # The run records the KV spec the app ran in full, as the packager named it in the manifest.
    from kvrig.bundle.manifest import load_manifest

    assert soak.scheme == load_manifest(result.bundle).recipe.kv


def _no_swift_here(monkeypatch: pytest.MonkeyPatch) -> None:
    # No Swift toolchain: MLX Swift cannot be resolved on any machine, with or without network.
    monkeypatch.delenv("KVRIG_SWIFT_DEPS", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")


def test_auto_runtime_falls_back_to_python_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrig.virtual.swiftapp import resolve_runtime

    _no_swift_here(monkeypatch)
    choice = resolve_runtime("auto")
    assert choice.runtime == "python"
    assert "cannot be built here (MLX Swift packages not resolvable: no `swift` on PATH" in choice.why


def test_swift_runtime_asked_for_does_not_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrig.exceptions import SwiftDepsNotFoundError
    from kvrig.virtual.swiftapp import resolve_runtime

    _no_swift_here(monkeypatch)
    with pytest.raises(SwiftDepsNotFoundError) as failure:
        resolve_runtime("swift")
    assert failure.value.exit_code == 30
    assert resolve_runtime("python").runtime == "python"


@pytest.mark.parametrize(
    ("outcome", "safe", "step", "within"),
    [("jetsam", None, (0, 512), False), ("jetsam_log", 1024, (1024, 1536), True), ("completed", 4096, None, None)],
    ids=["killed-in-the-first-step", "killed-without-a-report", "never-killed"],
)
def test_the_kill_step_counts_every_jetsam(
    outcome: str, safe: int | None, step: tuple[int, int] | None, within: bool | None, tmp_path: Path
) -> None:
    """A kill in the first step (no step survived) and a kill the log shows without a JetsamEvent report are
    kills: the plan is judged against them, never read as 'no kill'."""
    from kvrig.demo import DemoResult
    from kvrig.schemas.results import DeviceRef, SoakResult

    soak = SoakResult.model_validate(
        {"run_id": "r", "device": DeviceRef(udid="u").model_dump(), "app_id": "a", "scheme": "k8v4"}
    ).model_copy(update={"outcome": outcome, "max_safe_context": safe})
    result = DemoResult(tmp_path, tmp_path, tmp_path, "iphone-15-pro", 1, 1400, 1200, 0.1, 1, soak, tmp_path)
    result.step_tokens = 512
    assert result.killed_in_step == step and result.plan_within_one_step is within
    # `kvrig demo --json` carries what the text shows: the margin, the outcome's detail, the step of the kill
    from kvrig.cli.demo import _as_dict

    row = _as_dict(result)
    assert row["margin"] == 0.1 and row["outcome"] == outcome and row["outcome_detail"] == soak.outcome_detail
    assert (row["killed_growing_from"], row["killed_growing_to"]) == (step or (None, None))


def test_several_schemes_and_steps_each_get_their_own_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`run_demos` (what `kvrig demo --kv A,B --prefill-step P,Q` calls), with `run_demo` replaced by a recorder:
    the runs in order, each in `<kv>-p<step>` under the output, its lines tagged; one run in the output itself."""
    import kvrig.demo as demo

    calls: list[DemoOptions] = []

    def fake(options: DemoOptions, on_event=None):  # type: ignore[no-untyped-def]
        calls.append(options)
        if on_event is not None:
            on_event("packaging")
        return options.out

    monkeypatch.setattr(demo, "run_demo", fake)
    lines: list[tuple[str, str]] = []
    base = DemoOptions(out=tmp_path, weights="q4", room_tokens=1024)
    got = demo.run_demos(base, ["k8v4", "fp16"], [256, 512], on_event=lambda tag, line: lines.append((tag, line)))
    assert got == [tmp_path / "k8v4-p256", tmp_path / "k8v4-p512", tmp_path / "fp16-p256", tmp_path / "fp16-p512"]
    assert [(c.kv, c.prefill_step) for c in calls] == [("k8v4", 256), ("k8v4", 512), ("fp16", 256), ("fp16", 512)]
    assert {(c.weights, c.room_tokens) for c in calls} == {("q4", 1024)}  # the rest as given
    assert lines[0] == ("k8v4/p256", "packaging") and lines[-1] == ("fp16/p512", "packaging")
    calls.clear()
    assert demo.run_demos(base, ["k8v4"], [512]) == [tmp_path] and calls[0].kv == "k8v4"
