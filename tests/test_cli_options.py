"""Options read with the recipe grammar are refused at the command line, naming the option, before any model is
read or MLX imported (`--schemes k9v9` used to be refused after seconds of loading, and `--weights q3
--group-size 100` blamed "KV spec 'k8v8'")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrig.exceptions import BundleError, DeviceNotFoundError, QuantizationError

# Runs one command in a fresh interpreter and reports its exit code, stderr and whether MLX was imported.
PROBE = """
import contextlib, io, json, sys
from kvrig.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        main(sys.argv[1:])
        code = 0
    except SystemExit as exc:
        code = exc.code
print(json.dumps({"code": code, "err": err.getvalue(), "mlx": "mlx.core" in sys.modules}))
"""


def probe(*args: str, cwd: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=True, cwd=cwd)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    ("args", "code", "option", "needle"),
    [
        (["plan", "-d", "iPhone16,1", "--kv", "k8v4,k9v9"], QuantizationError.exit_code, "--kv", "k9v9"),
        (["plan", "-d", "iPhone16,1", "--weights", "q3", "--group-size", "100"], 2, "--group-size", "100"),
        (["plan", "-d", "iPhone16,1", "--recipes", "q4,gpx-q7"], QuantizationError.exit_code, "--recipes", "gpx"),
        (["plan", "-d", "iPhone16,1", "--kv-group-size", "48"], 2, "--kv-group-size", "48"),
        (["package", "--weights", "q9", "-o", "out"], QuantizationError.exit_code, "--weights", "q9"),
        (["package", "--kv", "k8v4+zz", "-o", "out"], QuantizationError.exit_code, "--kv", "+zz"),
        (["demo", "--kv", "auto,k4v1", "-o", "out"], QuantizationError.exit_code, "--kv", "k4v1"),
        (["bench", "quantize", "--recipes", "gpx-q4,bogus"], QuantizationError.exit_code, "--recipes", "bogus"),
        (["bench", "quantize", "--recipes", "dwq-q9"], QuantizationError.exit_code, "--recipes", "q9"),
        (["bench", "quality", "--recipes", "q4,q4x", "-o", "out"], QuantizationError.exit_code, "--recipes", "q4x"),
        (["calibrate", "r.json", "--weights", "q4x", "-o", "out"], QuantizationError.exit_code, "--weights", "q4x"),
        (["bench", "quality", "--kv", "fp16,k9v9", "-o", "out"], QuantizationError.exit_code, "--kv", "k9v9"),
        (["bench", "quality", "--factual-recipe", "q9", "-o", "out"], QuantizationError.exit_code, "--factual", "q9"),
        # --force meant three things: now refused, naming the flag for each
        (["package", "--force", "-o", "out"], 2, "--ignore-gate", "--replace"),
        # app and export: --force meant replace, and says so
        (["app", "b", "--name", "X", "--bundle-id", "com.x.y", "-o", "out", "--force"], 2, "--force", "--replace"),
        (["export", "coreml", "b", "-o", "out.mlpackage", "--force"], 2, "--force", "--replace"),
    ],
)
def test_a_bad_recipe_or_group_is_refused_at_the_command_line(
    args: list[str], code: int, option: str, needle: str, tmp_path: Path
) -> None:
    seen = probe(*args, cwd=tmp_path)
    assert seen["code"] == code, seen
    assert option in seen["err"] and needle in seen["err"], seen
    assert not seen["mlx"], "refused only after MLX was imported"
    assert list(tmp_path.iterdir()) == [], "nothing written"


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["plan", "-d", "iPhone16,1", "--buffer-cache-mb", "nan"], 2, "'--buffer-cache-mb'"),
        (["plan", "-d", "iPhone16,1", "--buffer-cache-mb", "inf"], 2, "'--buffer-cache-mb'"),
        (["plan", "-d", "iPhone16,1", "--cap", "-5"], 2, "--cap"),
        (["plan", "-d", "iPhone16,1", "--cap", "0"], 2, "--cap"),
        (["plan", "-d", "iPhone16,1", "--contexts", "99999999999999"], 3, "field 'contexts'"),
        (["plan", "-d", "iPhone16,1", "--prefill-step", "99999999999"], 3, "field 'prefill_step'"),
        (["plan", "-d", "iPhone16,1", "--target-context", "99999999999"], 3, "field 'target_context'"),
        (["bench", "quality", "--contexts", "abc"], 2, "'--contexts'"),
        (["plan", "-d", "iPhone16,1", "--schemes", " , "], 2, "'--kv' / '--schemes'"),  # the older name
        (["plan", "-d", "iPhone16,1", "--recipes", ","], 2, "'--recipes'"),
        (["virtual", "start", "--state", "never", "--baseline-mb", "nan"], 2, "'--baseline-mb'"),
        (["virtual", "start", "--state", "never", "--limit-mb", "-1"], 2, "'--limit-mb'"),
        (["demo", "--prefill-step", "0,512", "-o", "never"], 2, "'--prefill-step'"),
        (["package", "--prefill-step", "0", "-o", "never"], 2, "'--prefill-step'"),
        (["package", "--max-ppl-increase", "nan", "-o", "never"], 2, "'--max-ppl-increase'"),
        (["package", "--page-tokens", "0", "-o", "never"], 2, "'--page-tokens'"),
        (["package", "--keep-tokens", "-1", "-o", "never"], 2, "'--keep-tokens'"),
        (["package", "--quantized-kv-start", "-5", "-o", "never"], 2, "'--quantized-kv-start'"),
        (["package", "--max-context", "0", "-o", "never"], 2, "'--max-context'"),
        # a NaN limit never triggers: a hang watch that never fires, a timeout that never ends
        (["soak", "--app-id", "x", "--hang-after", "nan", "-o", "never"], 2, "'--hang-after'"),
        (["soak", "--app-id", "x", "--timeout", "inf", "-o", "never"], 2, "'--timeout'"),
        (["soak", "--app-id", "x", "--reconnect", "inf", "-o", "never"], 2, "'--reconnect'"),
        (["run", "never", "-p", "hi", "--temperature", "nan"], 2, "'--temperature'"),
        (["plan", "-d", "iPhone16,1", "--margin", "nan"], 2, "'--margin'"),
        (["bench", "quantize", "--timeout", "nan"], 2, "'--timeout'"),
    ],
)
def test_numbers_out_of_range_are_refused_at_once_naming_the_option(
    args: list[str], code: int, needle: str, tmp_path: Path
) -> None:
    """NaN, infinite, negative and absurdly large numbers: a usage error (2) or the plan's input error (3) naming
    what was wrong, in seconds (a context of 10^14 tokens used to run for minutes, NaN to end in a traceback)."""
    seen = probe(*args, cwd=tmp_path)
    assert seen["code"] == code, seen["err"]
    assert needle in seen["err"] and "Traceback" not in seen["err"]
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("command", [["package", "-d", "nosuch"], ["demo", "--device", "nosuch"]])
def test_an_unknown_device_is_refused_before_the_model_is_read(command: list[str], tmp_path: Path) -> None:
    """package used to measure the source's KV specs for 40 s and then refuse the device, demo to package for as
    long and leave the bundle. (Both re-execute themselves to preload OpenBLAS, so this runs the command itself
    rather than the in-process probe.)"""
    done = subprocess.run(
        [sys.executable, "-m", "kvrig", *command, "-o", "never"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], "nothing ran before the refusal"
    assert "unknown device profile 'nosuch'" in done.stderr and list(tmp_path.iterdir()) == []


def test_soak_refuses_schedule_options_a_plan_file_would_override(tmp_path: Path) -> None:
    """With --plan, --max-tokens/--step-tokens/--decode-tokens were dropped without a word (the file's schedule
    ran). `--step` is --step-tokens' older name: still accepted, and named as the option is now."""
    from kvrig.soaking.plan import make_plan

    plan = tmp_path / "plan.json"
    plan.write_text(make_plan(max_tokens=512).model_dump_json(by_alias=True))
    seen = probe(
        "soak",
        "--app-id",
        "com.x.y",
        "--plan",
        str(plan),
        "--max-tokens",
        "2048",
        "--step",
        "1024",
        "-o",
        "out",
        cwd=tmp_path,
    )
    assert seen["code"] == 2 and "--max-tokens, --step-tokens with --plan" in seen["err"], seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@pytest.mark.parametrize(
    "args",
    [
        ["soak", "--app-id", "x", "--plan", "{missing}", "-o", "never"],
        ["soak", "--app-id", "x", "--plan", "{folder}", "-o", "never"],
        ["lab", "run", "{folder}", "-o", "never"],
        ["lab", "run", "{missing}", "-o", "never"],
        ["lab", "report", "{folder}"],
        ["calibrate", "{missing}", "--limits", "{folder}"],
        ["plan", "-d", "iPhone16,1", "--quality", "{folder}"],
        ["plan", "-d", "iPhone16,1", "--limits", "{missing}"],
        ["devices", "--limits", "{folder}"],
    ],
)
def test_a_file_that_is_missing_or_a_folder_is_one_cause_everywhere(args: list[str], tmp_path: Path) -> None:
    """Options click checked were usage errors (2), the same files read by kvrig input errors (3): now 3 for all."""
    (tmp_path / "adir").mkdir()
    filled = [a.format(missing="nofile.json", folder="adir") for a in args]
    seen = probe(*filled, cwd=tmp_path)
    assert seen["code"] == 3, seen
    assert ("nofile.json" in seen["err"] or "adir" in seen["err"]) and "Traceback" not in seen["err"], seen
    assert not (tmp_path / "never").exists()


def test_a_soak_that_reaches_no_phone_leaves_no_folder(tmp_path: Path) -> None:
    env = {**os.environ, "USBMUXD_SOCKET_ADDRESS": f"UNIX:{tmp_path / 'nobody.sock'}"}
    done = subprocess.run(
        [sys.executable, "-m", "kvrig", "soak", "--app-id", "com.x.y", "-o", "out/soak"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == DeviceNotFoundError.exit_code, done.stderr
    assert f"cannot reach usbmuxd at {tmp_path / 'nobody.sock'}" in done.stderr  # where it looked
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"telemetry_file": "../../../etc/passwd"}, "telemetry_file"),
        ({"run_id": "../x"}, "run_id"),
        ({"text": ""}, "text"),
        ({"schedule": {"start_tokens": 100000, "step_tokens": 512, "max_tokens": 4096}}, "schedule"),
        ({"schedule": {"start_tokens": 1, "step_tokens": 1, "max_tokens": 1e30}}, "schedule.max_tokens"),
        ({"stop": {"max_seconds": float("inf")}}, "stop.max_seconds"),
    ],
)
def test_a_soak_plan_the_app_could_not_run_is_refused_before_the_phone(
    edit: dict[str, object], field: str, tmp_path: Path
) -> None:
    """Each reached the phone: an endless soak, a telemetry file outside Documents, a run with no text to feed."""
    from kvrig.soaking.plan import make_plan

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({**make_plan(max_tokens=4096).model_dump(mode="json", by_alias=True), **edit}))
    seen = probe("soak", "--app-id", "com.x.y", "--plan", str(plan), "-o", "out", cwd=tmp_path)
    assert seen["code"] == 3, seen
    assert str(plan) in seen["err"] and f"field '{field}'" in seen["err"], seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@pytest.mark.parametrize(
    "args",
    [["verify", "empty"], ["run", "empty", "-p", "hi"], ["deploy", "empty", "--app-id", "com.x.y"]],
    ids=["verify", "run", "deploy"],
)
def test_a_folder_that_is_not_a_bundle_is_one_cause_everywhere(args: list[str], tmp_path: Path) -> None:
    """A folder without manifest.json was exit 3 (a schema error) for verify and run, 8 (a file that does not match
    its manifest) for deploy, and 7 when the folder did not exist: one cause, BundleError, 7."""
    (tmp_path / "empty").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert done.returncode == BundleError.exit_code == 7, done.stderr
    assert "no manifest.json" in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1  # the error alone: no empty push bar drawn before the refusal


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["demo", "-o", "afile/sub"], 38),
        (["bench", "quality", "--recipes", "", "--kv", "", "--factual-recipe", "", "-o", "afile/sub"], 38),
        (["virtual", "start", "--socket", "./v.sock", "--state", "afile/sub", "--detach"], 3),
    ],
    ids=["demo", "bench quality", "virtual start"],
)
def test_a_folder_under_a_file_is_refused_naming_it(args: list[str], code: int, tmp_path: Path) -> None:
    """An output folder whose parent is a file was exit 70 (a bug in kvrig): now the error of the output (38) or of
    the option (3), naming the path, and nothing written."""
    (tmp_path / "afile").write_text("mine")
    done = subprocess.run(
        [sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert done.returncode == code, done.stderr
    assert "afile/sub" in done.stderr and "cannot create" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["soak", "--app-id", "com.example.x", "-o", "afile"], 38, "it exists and is not a folder"),
        (["demo", "-o", "afile"], 38, "it exists and is not a folder"),
        (["lab", "merge", "afile", "-o", "merged"], 3, "is not a folder (given to FOLDERS)"),
        (["lab", "merge", "gone", "-o", "merged"], 3, "not found (given to FOLDERS)"),
        (["virtual", "stop", "--socket", "./v.sock", "--state", "afile"], 3, "is not a folder (given to --state)"),
    ],
    ids=["soak", "demo", "lab merge of a file", "lab merge of nothing", "virtual stop"],
)
def test_a_file_where_a_folder_goes_is_the_folders_error(args: list[str], code: int, says: str, tmp_path: Path) -> None:
    """A file given as an output folder was click's usage error (2) in soak and demo, where every other output is
    the output's own error (38); a folder to read that is a file or missing was 3 or 42 by which: now 3 for both,
    as every input. Nothing is written and the file is left as it was."""
    (tmp_path / "afile").write_text("mine")
    done = subprocess.run(
        [sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert done.returncode == code, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_lab_output_that_is_a_file_is_not_called_a_labs_results(tmp_path: Path) -> None:
    """The lab's claim on its folder read a file there as "holds a lab's results already" (34)."""
    from kvrig.exceptions import OutputWriteError
    from kvrig.lab.schedule import claim_output

    (tmp_path / "afile").write_text("mine")
    with pytest.raises(OutputWriteError, match="it exists and is not a folder"):
        claim_output(tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "mine"


def test_every_dash_o_takes_both_long_names() -> None:
    """`-o` was `--output` in some commands and `--out` in others (`kvrig calibrate x --output y`: no such option)."""
    import click

    from kvrig.cli import cli

    def walk(command: click.Command, path: str) -> Iterator[tuple[str, click.Parameter]]:
        for param in command.params:
            yield path, param
        if isinstance(command, click.Group):  # the commands load lazily: ask the group for each
            context = click.Context(command)
            for name in command.list_commands(context):
                sub = command.get_command(context, name)
                assert sub is not None, name
                yield from walk(sub, f"{path} {name}")

    seen = [(path, p) for path, p in walk(cli, "kvrig") if "-o" in getattr(p, "opts", [])]
    assert len(seen) >= 9, [path for path, _ in seen]
    for path, param in seen:
        assert {"--out", "--output"} <= set(param.opts), (path, param.opts)
