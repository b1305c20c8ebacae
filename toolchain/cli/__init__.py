"""The `kvrig` command. Command groups are imported lazily so `kvrig --help` and the device commands never
import MLX; errors from the library are mapped to messages and exit codes here, in one place."""

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
    "build": "toolchain.cli.app:build",
    "plan": "toolchain.cli.plan:plan",
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
    "export": "toolchain.cli.export:export",
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

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help lists each command with its first docstring line without importing its module.
        rows = [(name, _SHORT_HELP.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


_SHORT_HELP: dict[str, str] = {
    "jetsam": "Read JetsamEvent reports: memory, killed processes and why, the verdict for our app.",
    "lab": "Run a matrix of apps, bundles and KV schemes on many phones as CI: results, JUnit, report, gates.",
    "app": "Generate the MLX-Swift iPhone app (Xcode project + Core package) for a bundle.",
    "deploy": "Install the app and push a model bundle into its Documents (resumable).",
    "devices": "List attached iPhones (real or virtual) with their device profile.",
    "build": "Build a generated app into an .ipa with xcodegen and xcodebuild (macOS only).",
    "plan": "Plan memory for a model on a device: weights, KV cache per scheme, max context.",
    "profiles": "List and show the device profiles kvrig knows.",
    "package": "Quantize a model into a bundle for the phone (weights, kvcache.json, manifest).",
    "run": "Generate on the host with a bundle's KV configuration; print tok/s and peak memory.",
    "verify": "Re-check every bundle file against its manifest.",
    "bench": "Benchmarks (runtime: our host runtime vs plain mlx-lm on one bundle).",
    "soak": "Grow the app's context on a device until it completes or jetsam kills it; write results.json.",
    "telemetry": "Summarise the app's JSONL telemetry per run; correlate a run with its jetsam report.",
    "virtual": "Run a virtual USB iPhone that pymobiledevice3 drives (start, stop, status).",
    "calibrate": "Fit the planner's baseline per device profile to measured soaks; write calibration.json.",
    "export": "Write a bundle for another runtime: a stateful Core ML program (coreml).",
    "demo": "The main job on a virtual iPhone: package, plan, build, deploy, soak until jetsam, compare.",
}


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
