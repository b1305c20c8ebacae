"""Every `kvrig` command in a fenced shell block of README.md, docs/ and examples/README.md parses as the command
line would parse it today: the command exists, every option exists and takes its value (recipes and KV specs read
by the recipe grammar, group sizes checked). Only a path that exists on the reader's machine (a bundle the block
made earlier) may be missing here. What the commands claim to print is checked by the tests of each command."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from kvrig.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
FENCE = re.compile(r"^```(\w*)\s*$")
SHELL = {"bash", "sh", "shell", "console"}
OPERATORS = {";", "&", "&&", "||", "|"}
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass(frozen=True)
class Documented:
    file: str
    line: int
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: kvrig {' '.join(self.args)}"


def documented_commands() -> list[Documented]:
    found = []
    for path in DOCS:
        env: dict[str, str] = {}
        shell = False
        pending, start = "", 0
        for number, line in enumerate(path.read_text().splitlines(), 1):
            fence = FENCE.match(line)
            if fence:
                shell, env = (not shell and fence.group(1) in SHELL), {}
                continue
            if not shell:
                continue
            text = line.strip().removeprefix("$ ")
            if not pending:
                start = number
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            text, pending = pending + text, ""
            lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words: list[str] = []
            try:
                tokens = [*lexer, ";"]
            except ValueError as exc:  # an unclosed quote: the reader's shell would refuse it too
                raise AssertionError(f"{path.relative_to(ROOT)}:{start}: {exc}: {text}") from None
            for token in tokens:
                if token not in OPERATORS:
                    words.append(_expand(token, env))
                    continue
                if words[:1] == ["export"] and "=" in words[1]:
                    key, value = words[1].split("=", 1)
                    env[key] = value  # later lines of this block expand it (the process's own env is left alone)
                elif words[:1] == ["kvrig"]:
                    found.append(Documented(str(path.relative_to(ROOT)), start, tuple(words[1:])))
                words = []
    return found


def _expand(token: str, env: dict[str, str]) -> str:
    """$X and ${X} from the block's own `export X=...` lines; anything else stays as written."""
    return VARIABLE.sub(lambda m: env.get(m[1] or m[2], m[0]), token)


COMMANDS = documented_commands()


def test_the_docs_hold_commands() -> None:
    assert len(COMMANDS) >= 20, [str(c) for c in COMMANDS]


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_a_documented_command_parses(command: Documented) -> None:
    group: click.Command = cli
    ctx = cli.make_context("kvrig", list(command.args))
    rest = [*ctx._protected_args, *ctx.args]
    while isinstance(group, click.Group) and rest:
        name, sub, rest = group.resolve_command(ctx, rest)
        assert sub is not None, f"{command}: no command {name!r}"
        try:
            ctx = sub.make_context(name, list(rest), parent=ctx)
        except click.BadParameter as exc:
            # a bundle or report the reader's earlier commands made: only a path's existence may be missing
            assert isinstance(exc.param, click.Argument | click.Option) and isinstance(exc.param.type, click.Path), (
                f"{command}: {exc.format_message()}"
            )
            return
        group, rest = sub, [*ctx._protected_args, *ctx.args] if isinstance(sub, click.Group) else []
