"""Every `kvrig` command in a fenced shell block of README.md, docs/ and examples/README.md parses as the command
line would parse it today, and runs as the block claims. An HTML comment right before each block with kvrig
commands names the block and says, one line per kvrig command in order, what the command does:

    <!-- docs-test NAME [bash]
    exit 0, "a fact of its output"           run in a temp folder after the block's setup (SETUPS below)
    with --max-tokens 8: exit 0, "tok/s"     run with those options added: a smaller size than the doc's
    instead: WHY                             not run: the setup makes what it makes (a bundle the session built)
    covered: tests/FILE.py::TEST             not run here: that test runs it
    measured: NAME                           not run here: docs/benchmarks.yaml's NAME runs it for the docs
    phone: WHY                               needs a real iPhone
    -->

Blocks run in this process, on the embedded model and a virtual iPhone, except `bash` ones (shell variables,
background jobs, `$(...)`: the labs on virtual phones), which bash runs line by line as a reader would."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest

from kvrig.cli import cli
from kvrig.docgen import load_benchmarks
from kvrig.exceptions import InputError
from tests.cli_run import run

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
FENCE = re.compile(r"^```(\w*)\s*$")
SHELL = {"bash", "sh", "shell", "console"}
OPERATORS = {";", "&", "&&", "||", "|"}
MIB = 2**20
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
ANNOTATION = re.compile(r"<!-- docs-test (?P<name>[\w-]+)(?P<bash> bash)?\n(?P<lines>.*?)-->\n$", re.S)
EXPECT = re.compile(
    r"^(?:with (?P<extra>[^:]+): )?exit (?P<code>\d+)(?P<facts>(?:, \"[^\"]*\")*)$"
    r"|^(?P<kind>instead|covered|measured|phone): (?P<note>.+)$"
)


@dataclass(frozen=True)
class Documented:
    file: str
    line: int
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: kvrig {' '.join(self.args)}"


@dataclass(frozen=True)
class Expect:
    kind: str  # exit, instead, covered, measured, phone
    code: int = 0
    facts: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Block:
    file: str
    line: int
    text: str
    commands: tuple[Documented, ...]
    name: str = ""
    bash: bool = False
    expects: tuple[Expect, ...] = ()

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.name}"


def documented_blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        lines = path.read_text().splitlines(keepends=True)
        start = None
        for number, line in enumerate(lines, 1):
            fence = FENCE.match(line)
            if not fence:
                continue
            if start is None:
                start = number if fence.group(1) in SHELL else -number
                continue
            if start > 0:
                before = "".join(lines[: start - 1])
                blocks.append(_block(path, start, "".join(lines[start : number - 1]), before))
            start = None
    return [b for b in blocks if b.commands]


def _block(path: Path, start: int, text: str, before: str) -> Block:
    file = str(path.relative_to(ROOT))
    commands = tuple(_commands(file, start, text))
    found = ANNOTATION.search(before[before.rfind("<!-- docs-test") :])
    if found is None:
        return Block(file, start, text, commands)
    expects = []
    for line in found["lines"].strip().splitlines():
        m = EXPECT.match(line.strip())
        assert m is not None, f"{file}:{start}: not an expectation: {line!r}"
        if m["kind"]:
            expects.append(Expect(m["kind"], note=m["note"]))
        else:
            facts = tuple(re.findall(r'"([^"]*)"', m["facts"]))
            expects.append(Expect("exit", int(m["code"]), facts, tuple(shlex.split(m["extra"] or ""))))
    return Block(file, start, text, commands, found["name"], bool(found["bash"]), tuple(expects))


def _commands(file: str, start: int, text: str) -> Iterator[Documented]:
    env: dict[str, str] = {}
    pending, first = "", 0
    for number, line in enumerate(text.splitlines(), start + 1):
        line = line.strip().removeprefix("$ ")
        if not pending:
            first = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        try:
            tokens = [*lexer, ";"]
        except ValueError as exc:  # an unclosed quote: the reader's shell would refuse it too
            raise AssertionError(f"{file}:{first}: {exc}: {line}") from None
        for token in tokens:
            if token not in OPERATORS:
                words.append(_expand(token, env))
                continue
            if words[:1] == ["export"] and "=" in words[1]:
                key, value = words[1].split("=", 1)
                env[key] = value  # later lines of this block expand it (the process's own env is left alone)
            elif words[:1] == ["kvrig"]:
                yield Documented(file, first, tuple(words[1:]))
            words = []


def _expand(token: str, env: dict[str, str]) -> str:
    """$X and ${X} from the block's own `export X=...` lines; anything else stays as written."""
    return VARIABLE.sub(lambda m: env.get(m[1] or m[2], m[0]), token)


BLOCKS = documented_blocks()
COMMANDS = [c for b in BLOCKS for c in b.commands]


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
        except InputError as exc:  # the same, from a path kvrig checks itself (cli.options.InputPath)
            assert exc.file in command.args and not Path(exc.file).exists(), f"{command}: {exc}"
            return
        group, rest = sub, [*ctx._protected_args, *ctx.args] if isinstance(sub, click.Group) else []


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_block_says_what_each_command_claims(block: Block) -> None:
    assert block.name, f"{block}: no <!-- docs-test NAME ... --> right before the block"
    assert len(block.expects) == len(block.commands), (
        f"{block}: {len(block.commands)} kvrig commands, {len(block.expects)} expectations"
    )
    assert block.name in SETUPS, f"{block}: no setup {block.name!r} in {__name__}.SETUPS"
    benchmarks = load_benchmarks(ROOT)
    for command, expect in zip(block.commands, block.expects, strict=True):
        if expect.kind == "covered":
            file, _, test = expect.note.split()[0].partition("::")
            assert (ROOT / file).is_file(), f"{command}: {expect.note}"
            assert not test or f"def {test}(" in (ROOT / file).read_text(), f"{command}: {expect.note}"
        elif expect.kind == "measured":
            bench = benchmarks[expect.note.split()[0]]
            # the measurement runs the same command (at its own sizes)
            assert bench.run.split()[1:3] == list(command.args[:2]), f"{command}: {expect.note}: {bench.run}"


# --- running the blocks ---------------------------------------------------------------------------------------


@dataclass
class Setup:
    """The folder a block runs in and the words that stand for what a reader has (a UDID, a model folder)."""

    cwd: Path
    placeholders: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


SetupFn = Callable[[pytest.FixtureRequest, Path], contextlib.AbstractContextManager[Setup]]


@contextlib.contextmanager
def _with_bundle(request: pytest.FixtureRequest, cwd: Path) -> Iterator[Setup]:
    """`kvrig package ... -o out/smollm2` takes minutes with its defaults (every recipe measured against the
    gate): the session's q4/k8v8 bundle stands in for it."""
    (cwd / "out").mkdir()
    (cwd / "out" / "smollm2").symlink_to(request.getfixturevalue("q4_k8v8_bundle"))
    yield Setup(cwd)


@contextlib.contextmanager
def _real_iphone(request: pytest.FixtureRequest, cwd: Path) -> Iterator[Setup]:
    """A virtual iPhone 15 Pro with a small limit, and the app the README's `kvrig app` renders, built for it
    (`kvrig build --virtual`, as a Mac's `kvrig build` makes the .ipa) to run the virtual iPhone's test app: it
    grows its memory as an LLM's KV cache grows, in seconds where SmolLM2's prefill would take a minute here.
    The commands, the bundle pushed, the reports and the files between them are the README's."""
    from kvrig.appgen.render import AppOptions, render_app
    from kvrig.appgen.virtual_ipa import build_virtual_ipa
    from tests.virtual.conftest import emulator_host

    with _with_bundle(request, cwd) as setup:
        options = AppOptions(name="SmolLM2 Demo", bundle_id="dev.kvrig.demo")
        project = render_app(cwd / "out" / "smollm2", cwd / "project", options).project
        build_virtual_ipa(project, cwd / "ipa", runtime="test").rename(cwd / "SmolLM2Demo.ipa")  # a Mac's name
        with emulator_host(cwd, "docs") as host:
            phone = host.add_device(
                cwd / "phone", profile="iPhone16,1", limit_bytes=160 * 2**20, baseline_bytes=48 * 2**20
            )
            setup.placeholders["U"] = phone.identity.udid
            yield setup


@contextlib.contextmanager
def _planning(request: pytest.FixtureRequest, cwd: Path) -> Iterator[Setup]:
    """A Hugging Face folder and a bare config.json where the doc names placeholders: SmolLM2 converted."""
    source: Path = request.getfixturevalue("source_folder")
    yield Setup(cwd, {"path/to/hf-model": str(source), "config.json": str(source / "config.json")})


@contextlib.contextmanager
def _quality(request: pytest.FixtureRequest, cwd: Path) -> Iterator[Setup]:
    """The quality.json `kvrig bench quality` writes: the one the docs' KV measurement printed."""
    measured = json.loads((ROOT / "docs" / "data" / "quality-kv.json").read_text())["result"]
    (cwd / "build" / "quality").mkdir(parents=True)
    (cwd / "build" / "quality" / "quality.json").write_text(json.dumps(measured))
    yield Setup(cwd)


@contextlib.contextmanager
def _examples(request: pytest.FixtureRequest, cwd: Path) -> Iterator[Setup]:
    """A copy of examples/ (make_test_ipa.py writes into it) in a folder of the block's own."""
    shutil.copytree(ROOT / "examples", cwd / "examples")
    yield Setup(cwd)


@contextlib.contextmanager
def _examples_ipa(request: pytest.FixtureRequest, cwd: Path) -> Iterator[Setup]:
    """As the block before it in examples/README.md left it: the test app's .ipa written."""
    with _examples(request, cwd) as setup:
        subprocess.run([sys.executable, "examples/make_test_ipa.py"], cwd=cwd, check=True, capture_output=True)
        yield setup


@contextlib.contextmanager
def _nothing(request: pytest.FixtureRequest, cwd: Path) -> Iterator[Setup]:
    yield Setup(cwd)


SETUPS: dict[str, SetupFn] = {
    "five-minutes": _with_bundle,
    "real-iphone": _real_iphone,
    "lab": _nothing,  # covered by the lab-virtual block
    "lab-virtual": _examples,
    "lab-two-hosts": _examples_ipa,
    "planning": _planning,
    "packaging": _with_bundle,
    "quality": _quality,
    "coreml": _nothing,
    "engine": _nothing,
}


@pytest.fixture(scope="module")
def q4_k8v8_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.bundle_fixtures import smollm2_q4_k8v8

    # The name test_runtime, test_package and test_plan_auto package these options under: one SmolLM2 packaging
    # per session, not two (~6.5 s of CPU); every block here only reads it.
    return smollm2_q4_k8v8(tmp_path_factory)


@pytest.fixture(scope="module")
def source_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.bundle_fixtures import converted_source

    return converted_source(tmp_path_factory)


def _runnable() -> list[pytest.ParameterSet]:
    return [
        pytest.param(block, id=str(block))
        for block in BLOCKS
        if block.name and any(e.kind == "exit" for e in block.expects)
    ]


@pytest.mark.parametrize("block", _runnable())
def test_a_documented_block_runs_as_it_claims(
    block: Block,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with SETUPS[block.name](request, tmp_path) as setup:
        monkeypatch.chdir(setup.cwd)
        if block.bash:
            _in_bash(block, setup)
            return
        for command, expect in zip(block.commands, block.expects, strict=True):
            if expect.kind != "exit":
                continue
            args = [_glob(setup.placeholders.get(a, a)) for a in command.args]
            code, out, err = run(capsys, *[a for arg in args for a in arg], *expect.extra)
            _check(command, expect, code, out + err)


def _glob(word: str) -> list[str]:
    """A word with a wildcard as the reader's shell expands it."""
    return sorted(glob.glob(word)) or [word] if "*" in word else [word]


def _check(command: Documented, expect: Expect, code: int, output: str) -> None:
    assert code == expect.code, f"{command}: exit {code}, the doc says {expect.code}\n{output[-3000:]}"
    for fact in expect.facts:
        assert fact in output, f"{command}: no {fact!r} in its output\n{output[-3000:]}"


# Every `kvrig` call of a bash-run block logs its arguments, output and exit code, so each documented command's
# claim is checked against what that call did.
SHIM = r"""
kvrig() {
    local log="$KVRIG_DOCS_LOG/$(date +%s%N)-$BASHPID"
    printf '%s\0' "$@" > "$log.args"
    "$KVRIG_PYTHON" -m kvrig "$@" > "$log.out" 2>&1
    local code=$?
    echo "$code" > "$log.code"
    cat "$log.out"
    return "$code"
}
"""


def _in_bash(block: Block, setup: Setup) -> None:
    logs = setup.cwd / ".kvrig-calls"
    logs.mkdir()
    env = {
        **os.environ,
        "KVRIG_DOCS_LOG": str(logs),
        "KVRIG_PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # `python` and `python3` as the venv's
        **setup.env,
    }
    sockets = [c.args[c.args.index("--socket") + 1] for c in block.commands if c.args[:2] == ("virtual", "start")]
    try:
        done = subprocess.run(
            ["bash", "-c", SHIM + block.text], cwd=setup.cwd, env=env, capture_output=True, text=True, timeout=600
        )
    finally:
        for socket in sockets:  # the block stops its phones; after a failure, this does
            subprocess.run([sys.executable, "-m", "kvrig", "virtual", "stop", "--socket", socket], env=env, check=False)
    calls = {
        tuple(p.read_text().split("\0")[:-1]): (
            int(p.with_suffix(".code").read_text()),
            p.with_suffix(".out").read_text(),
        )
        for p in logs.glob("*.args")
    }
    for command, expect in zip(block.commands, block.expects, strict=True):
        if expect.kind != "exit":
            continue
        assert command.args in calls, f"{command}: not run\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        _check(command, expect, *calls[command.args])


def test_the_architecture_pages_layers_are_the_import_contracts() -> None:
    """docs/architecture.md draws the layers that lint-imports holds (pyproject.toml): the same parts, in the same
    layers, top to bottom, so the page cannot drift from the contract."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawing = page.split("## The layers", 1)[1].split("```\n", 2)[1]
    drawn: list[set[str]] = []
    for line in drawing.splitlines():
        names = re.split(r"\s{2,}", line.strip())[0] if not line.startswith("  |") else line.split("|")[1]
        parts = {n.strip() for n in names.split("|") if n.strip()}
        if line.startswith("  |"):
            drawn[-1] |= parts  # a layer drawn on two lines
        else:
            drawn.append(parts)
    assert drawn == [{p.strip() for p in layer.split("|")} for layer in layers]
