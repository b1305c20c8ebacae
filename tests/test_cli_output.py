"""What people and pipes get from every command: full-width tables off a terminal, no colour when asked, `-q`
and `-v`, one line for a bug, and the versions that decide behaviour. Pipes and terminals are real ones (a
subprocess writing into a pipe, a pseudo-terminal), as a user's shell gives them."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from importlib.metadata import version

import click
import pytest

from kvrig.cli import COMMANDS, UNEXPECTED_EXIT
from kvrig.cli.output import info, warn
from tests.cli_run import run

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def kvrig(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed command with stdout a pipe, as `kvrig ... | cat` runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kvrig", *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    )


def on_a_terminal(*args: str, columns: int = 80, env: dict[str, str] | None = None) -> str:
    """The command's output on a pseudo-terminal `columns` wide (what a person sees)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal of that size, colour allowed unless env says otherwise
        environment = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "COLUMNS")}
        environment.update({"TERM": "xterm-256color", "COLUMNS": str(columns), **(env or {})})
        os.execve(sys.executable, [sys.executable, "-m", "kvrig", *args], environment)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode()


def test_a_piped_profile_list_names_every_profile_on_its_own_line() -> None:
    """`kvrig profiles list | grep -c iphone-15-pro` printed 0: rich had squeezed the names to fit 80 columns."""
    profiles = json.loads(kvrig("profiles", "list", "--json", env={"COLUMNS": "80"}).stdout)
    # each profile, then a line per other RAM size it was sold with (NAME@NGB)
    names = [
        name
        for p in profiles
        for name in [p["name"], *(f"{p['name']}@{v['ram_bytes']['value'] >> 30}GB" for v in p["ram_variants"])]
    ]
    piped = kvrig("profiles", "list", env={"COLUMNS": "80"}).stdout
    assert "…" not in piped
    first_cells = [line.split("│")[1].strip() for line in piped.splitlines() if line.startswith("│")]
    assert first_cells == names
    assert not ANSI.search(piped)


def test_a_piped_plan_shows_every_max_context_in_full() -> None:
    """`kvrig plan -d iPhone16,1 | cat` showed max context as "8,1…"."""
    planned = json.loads(kvrig("plan", "-d", "iPhone16,1", "--json").stdout)
    piped = kvrig("plan", "-d", "iPhone16,1").stdout
    assert "…" not in piped
    kv_table = piped[piped.index("KV cache by scheme") : piped.index("Decode ceiling")]
    rows = {line.split("│")[1].strip(): line for line in kv_table.splitlines() if line.startswith("│")}
    for scheme, tokens in planned["max_context"].items():
        assert f"{tokens:,}" in rows[scheme], (scheme, rows.get(scheme))


def test_a_terminal_gets_styles_and_no_color_takes_every_escape_away() -> None:
    styled = on_a_terminal("profiles", "show", "iPhone16,1", columns=200)
    assert ANSI.search(styled), "rich writes bold names on a terminal"
    assert not ANSI.search(on_a_terminal("--no-color", "profiles", "show", "iPhone16,1", columns=200))
    assert not ANSI.search(on_a_terminal("profiles", "show", "iPhone16,1", columns=200, env={"NO_COLOR": "1"}))


def test_a_narrow_terminal_keeps_its_width() -> None:
    """On a terminal rich fits the table to the screen (folding), and nothing runs past the edge."""
    shown = ANSI.sub("", on_a_terminal("--no-color", "profiles", "list", columns=100))
    assert max(len(line) for line in shown.splitlines()) <= 100


@click.command("talk-for-test")
@click.argument("what")
def _talk(what: str) -> None:
    info("step 1 of 2")
    warn("the gate was close")
    if what == "bug":
        {}["missing"]
    click.echo("the result")


@pytest.fixture
def talk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(COMMANDS, "talk-for-test", f"{__name__}:_talk")


def test_quiet_keeps_results_and_warnings_and_drops_progress(talk, capsys) -> None:  # type: ignore[no-untyped-def]
    code, out, err = run(capsys, "talk-for-test", "ok")
    assert (code, out) == (0, "the result\n")
    assert err.splitlines() == ["step 1 of 2", "kvrig: warning: the gate was close"]
    code, out, err = run(capsys, "-q", "talk-for-test", "ok")
    assert (code, out) == (0, "the result\n")
    assert err.splitlines() == ["kvrig: warning: the gate was close"]


def test_an_unexpected_error_is_one_line_and_verbose_shows_the_traceback(talk, capsys) -> None:  # type: ignore[no-untyped-def]
    code, _, err = run(capsys, "talk-for-test", "bug")
    assert code == UNEXPECTED_EXIT
    last = err.splitlines()[-1]
    assert last.startswith("kvrig: unexpected error: KeyError") and "rerun with -v" in last
    assert "Traceback" not in err
    code, _, err = run(capsys, "-v", "talk-for-test", "bug")
    assert code == UNEXPECTED_EXIT
    assert "Traceback (most recent call last)" in err and "KeyError: 'missing'" in err


def test_docs_render_check_speaks_json() -> None:
    done = kvrig("docs", "render", "--check", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"stale": []}


def test_docs_render_on_a_folder_without_the_docs_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """It rendered nothing and said nothing (exit 0) where `--check` and `docs measure` refuse (3)."""
    for check in ([], ["--check"]):
        command = [sys.executable, "-m", "kvrig", "docs", "render", "--root", str(tmp_path), *check]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 3 and "benchmarks.yaml: file not found" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_verbose_and_quiet_together_is_a_usage_error(capsys) -> None:  # type: ignore[no-untyped-def]
    code, _, err = run(capsys, "-v", "-q", "profiles", "list")
    assert code == click.UsageError.exit_code
    assert "-v and -q" in err


def test_version_names_the_packages_that_decide_behaviour() -> None:
    shown = kvrig("--version").stdout
    for name in ("mlx", "mlx-lm", "pymobiledevice3", "coremltools"):
        assert f"{name} {version(name)}" in shown, (name, shown)
    assert f"Python {sys.version.split()[0]}" in shown


def test_a_blocked_sigint_is_unblocked_and_an_ignored_one_kept() -> None:
    """A child inherits its parent's signal mask through exec: a parent that blocks SIGINT (a thread that was
    spawning, say) would leave kvrig's Ctrl-C pending forever. An ignored SIGINT (nohup, a shell's `&`) is meant."""
    probe = (
        "import signal, sys\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
        "handler = signal.SIG_IGN if sys.argv[1] == 'ignored' else signal.default_int_handler\n"
        "signal.signal(signal.SIGINT, handler)  # whatever this test process inherited\n"
        "from kvrig.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])\n"
        "print(blocked, signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
    )
    for how, expected in (("blocked", "False False"), ("ignored", "False True")):
        proc = subprocess.run([sys.executable, "-c", probe, how], capture_output=True, text=True, check=True)
        assert proc.stdout.strip().splitlines()[-1] == expected, (how, proc.stdout, proc.stderr)
