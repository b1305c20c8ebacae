"""The `kvrig` command. A command's module is imported only when the command runs or help lists it (click's
lazy-group pattern); command modules import MLX only inside their functions, so `kvrig --help` and the device
commands never import it. Errors from the library are mapped to messages and exit codes here, in one place."""

from __future__ import annotations

import importlib
import sys

import click

from kvrig.exceptions import KvrigError
from kvrig.version import __version__

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


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvrig")
def cli() -> None:
    """kvrig: the longest context your quantized LLM can hold on an iPhone without being killed."""


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="kvrig", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KvrigError as exc:
        click.echo(f"kvrig: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
