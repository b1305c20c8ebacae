"""The CI templates in examples/ci/: valid for their CI system (check-jsonschema's vendored GitHub-workflow and
GitLab-CI schemas, offline), and every kvrig command and option they use exists (`--help` runs for each)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from kvrig.cli import cli
from tests.lab.conftest import ROOT

CI = ROOT / "examples" / "ci"
TEMPLATES = {"github-actions.yml": "vendor.github-workflows", "gitlab-ci.yml": "vendor.gitlab-ci"}
# Any attempt to reach the network fails at once: the vendored schemas must be enough.
OFFLINE = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}


def check_jsonschema(schema: str, path: Path) -> subprocess.CompletedProcess[str]:
    checker = Path(sys.executable).parent / "check-jsonschema"
    return subprocess.run(
        [str(checker), "--builtin-schema", schema, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE},
        timeout=120,
    )


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_validates_against_its_ci_schema(name: str, tmp_path: Path) -> None:
    proc = check_jsonschema(TEMPLATES[name], CI / name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the checker rejects a job with a misspelt key
    data = yaml.safe_load((CI / name).read_text())
    job = data["jobs"]["lab"] if "jobs" in data else data["lab"]
    job["scripts" if "script" in job else "runs_on"] = job.pop("script" if "script" in job else "runs-on")
    broken = tmp_path / name
    broken.write_text(yaml.safe_dump(data))
    assert check_jsonschema(TEMPLATES[name], broken).returncode != 0


def shell_lines(name: str) -> list[str]:
    data = yaml.safe_load((CI / name).read_text())
    lines: list[str] = []
    if "jobs" in data:
        for job in data["jobs"].values():
            lines += [step["run"] for step in job["steps"] if "run" in step]
    else:
        for job in data.values():
            if isinstance(job, dict):
                lines += job.get("before_script", []) + job.get("script", [])
    return lines


def kvrig_commands() -> list[tuple[str, list[str], list[str]]]:
    """(template, command path, options) for every `kvrig ...` line of every template."""
    found = []
    for name in sorted(TEMPLATES):
        for line in shell_lines(name):
            words = shlex.split(line)
            if not words or words[0] != "kvrig":
                continue
            command: click.Command = cli
            path: list[str] = []
            ctx = click.Context(cli)
            for word in words[1:]:
                if not isinstance(command, click.Group):
                    break
                sub = command.get_command(ctx, word)
                assert sub is not None, f"{name}: `kvrig {' '.join([*path, word])}` is not a kvrig command"
                command, path = sub, [*path, word]
            found.append((name, path, [w.split("=")[0] for w in words if w.startswith("-")]))
    return found


def test_templates_use_kvrig_commands() -> None:
    paths = {tuple(p) for _, p, _ in kvrig_commands()}
    assert {("lab", "run"), ("lab", "merge"), ("devices",)} <= paths


@pytest.mark.parametrize("name,path,options", kvrig_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_command_and_option_a_template_uses_exists(name: str, path: list[str], options: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", *path, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    for option in options:
        assert option in proc.stdout.split() or f"{option}," in proc.stdout, f"{name}: kvrig {path} has no {option}"
