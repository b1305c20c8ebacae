"""The `kvrig` command. A command's module is imported only when the command runs or help lists it (click's
lazy-group pattern); command modules import MLX only inside their functions, so `kvrig --help` and the device
commands never import it. Errors from the library are mapped to messages and exit codes here, in one place."""

from __future__ import annotations

import importlib
import sys

import click

from toolchain import __version__
from toolchain.exceptions import KvrigError

# command name -> "module:attribute"; the module is imported only when the command runs.
COMMANDS: dict[str, str] = {
    "jetsam": "toolchain.cli.jetsam:jetsam",
    "lab": "toolchain.cli.lab:lab",
    "app": "toolchain.cli.app:app",
    "deploy": "toolchain.cli.device:deploy",
    "devices": "toolchain.cli.device:devices",
    "prepare": "toolchain.cli.device:prepare",
    "build": "toolchain.cli.app:build",
    "plan": "toolchain.cli.plan:plan",
    "plan-bench": "toolchain.cli.plan:plan_bench",
    "profiles": "toolchain.cli.profiles:profiles",
    "package": "toolchain.cli.package:package",
    "run": "toolchain.cli.run:run",
    "verify": "toolchain.cli.verify:verify",
    "bench": "toolchain.cli.bench:bench",
    "soak": "toolchain.cli.soak:soak",
    "telemetry": "toolchain.cli.telemetry:telemetry",
    "virtual": "toolchain.cli.virtual:virtual",
    "demo": "toolchain.cli.demo:demo",
    "calibrate": "toolchain.cli.calibrate:calibrate",
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
