"""The `kvrig` command. A command's module is imported only when the command runs or help lists it (click's
lazy-group pattern); command modules import MLX only inside their functions, so `kvrig --help` and the device
commands never import it. Errors from the library are mapped to messages and exit codes here, in one place."""

from __future__ import annotations

import importlib
import signal
import sys
import traceback

import click

from kvrig.cli.output import OUTPUT
from kvrig.exceptions import KvrigError, Terminated
from kvrig.version import DEPENDENCIES, __version__, dependency_versions

# command name -> "module:attribute"; the module is imported only when the command runs.
COMMANDS: dict[str, str] = {
    "jetsam": "kvrig.cli.jetsam:jetsam",
    "lab": "kvrig.cli.lab:lab",
    "app": "kvrig.cli.app:app",
    "deploy": "kvrig.cli.device:deploy",
    "devices": "kvrig.cli.device:devices",
    "prepare": "kvrig.cli.device:prepare",
    "build": "kvrig.cli.app:build",
    "engine": "kvrig.cli.app:engine",
    "plan": "kvrig.cli.plan:plan",
    "profiles": "kvrig.cli.profiles:profiles",
    "package": "kvrig.cli.package:package",
    "run": "kvrig.cli.run:run",
    "verify": "kvrig.cli.verify:verify",
    "bench": "kvrig.cli.bench:bench",
    "soak": "kvrig.cli.soak:soak",
    "telemetry": "kvrig.cli.telemetry:telemetry",
    "virtual": "kvrig.cli.virtual:virtual",
    "demo": "kvrig.cli.demo:demo",
    "calibrate": "kvrig.cli.calibrate:calibrate",
    "export": "kvrig.cli.export:export",
    "docs": "kvrig.cli.docs:docs",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)


# A bug in kvrig, not an error it reports (BSD's EX_SOFTWARE): CI can tell it from every kvrig exit code.
UNEXPECTED_EXIT = 70


def _versions() -> str:
    found = dependency_versions()
    deps = ", ".join(f"{name} {found[name] or 'not installed'}" for name in DEPENDENCIES)
    return f"kvrig {__version__} (Python {found['python']}; {deps})"


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(_versions())
        ctx.exit()


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_show_version,
    help="Show kvrig's version and those of mlx, mlx-lm, pymobiledevice3 and coremltools, and exit.",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging, and the traceback of an unexpected error.")
@click.option("-q", "--quiet", is_flag=True, help="Only results, warnings and errors: no progress lines.")
@click.option("--no-color", is_flag=True, help="No colour (also when NO_COLOR is set, or off a terminal).")
def cli(verbose: bool, quiet: bool, no_color: bool) -> None:
    """kvrig: the longest context your quantized LLM can hold on an iPhone without being killed."""
    if verbose and quiet:
        raise click.UsageError("-v and -q ask for opposite things; give one")
    OUTPUT.verbosity = 1 if verbose else -1 if quiet else 0
    OUTPUT.color = not no_color
    if verbose:
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")


def _terminate(signum: int, frame: object) -> None:
    raise Terminated("stopped by SIGTERM")


def main(argv: list[str] | None = None) -> None:
    OUTPUT.verbosity, OUTPUT.color = 0, True  # a fresh invocation (tests call main() many times in one process)
    # SIGTERM unwinds like Ctrl-C, so every `finally` runs: a package's hidden folders go, a soak stops its app.
    signal.signal(signal.SIGTERM, _terminate)
    # A signal mask is inherited through exec: a parent that started kvrig from a thread blocking SIGINT would
    # leave Ctrl-C pending forever (an ignored SIGINT, as `nohup` or a shell's `&` set it, is kept: that is meant).
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        cli.main(args=argv, prog_name="kvrig", standalone_mode=False)
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, Terminated):  # click turns every KeyboardInterrupt into Abort
            click.echo("kvrig: stopped by SIGTERM", err=True)
            sys.exit(Terminated.exit_code)
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KvrigError as exc:
        if OUTPUT.verbosity > 0:
            traceback.print_exc()
        click.echo(f"kvrig: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except Terminated:
        click.echo("kvrig: stopped by SIGTERM", err=True)
        sys.exit(Terminated.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if OUTPUT.verbosity > 0:
            traceback.print_exc()
            sys.exit(UNEXPECTED_EXIT)
        click.echo(
            f"kvrig: unexpected error: {type(exc).__name__}: {exc} (a bug in kvrig; rerun with -v for the traceback)",
            err=True,
        )
        sys.exit(UNEXPECTED_EXIT)
