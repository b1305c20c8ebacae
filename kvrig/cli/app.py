"""`kvrig app` (generate the Xcode project for a bundle) and `kvrig build` (xcodebuild it on macOS)."""

from __future__ import annotations

from pathlib import Path

import click

from kvrig.cli.options import retired_force_option
from kvrig.cli.output import info
from kvrig.cli.render import echo_json, json_option


@click.command("app", short_help="Generate the MLX-Swift iPhone app (Xcode project + Core package) for a bundle.")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--name", required=True, help="App display name (any text; escaped wherever it lands).")
@click.option("--bundle-id", required=True, help="Bundle identifier, e.g. com.example.myllm.")
@click.option("--team", default=None, help="Apple development team ID (10 characters) for signing.")
@click.option(
    "--extended-virtual-addressing",
    is_flag=True,
    help="Also request the extended-virtual-addressing entitlement.",
)
@click.option(
    "-o", "--output", "--out", "output", type=click.Path(path_type=Path), required=True, help="Project folder."
)
@click.option(
    "--replace",
    is_flag=True,
    help="Replace a project kvrig generated at -o (whole, in one rename); never another folder.",
)
@retired_force_option("use --replace to replace a project kvrig generated at -o")
@click.option(
    "--coreml",
    "coreml_model",
    type=click.Path(path_type=Path),
    help="Also ship this .mlpackage (from `kvrig export coreml`) and its Core ML engine beside the MLX bundle.",
)
@json_option
def app(
    bundle: Path,
    name: str,
    bundle_id: str,
    team: str | None,
    extended_virtual_addressing: bool,
    output: Path,
    replace: bool,
    coreml_model: Path | None,
    as_json: bool,
) -> None:
    """Generate the MLX-Swift iPhone app (XcodeGen project + Core package) for a bundle."""
    from kvrig.appgen.render import AppOptions, render_app

    options = AppOptions(
        name=name,
        bundle_id=bundle_id,
        team=team,
        extended_virtual_addressing=extended_virtual_addressing,
        coreml_model=coreml_model,
    )
    result = render_app(bundle, output, options, replace=replace)
    if as_json:
        echo_json({"project": str(result.project), "files": [str(p.relative_to(output)) for p in result.files]})
        return
    click.echo(f"wrote {len(result.files)} files to {result.project}")
    click.echo(f"on a Mac: cd {result.project} && xcodegen generate   (or: kvrig build {result.project})")
    click.echo(f"for the virtual iPhone, anywhere: kvrig build --virtual {result.project}")
    click.echo(f"push the bundle into the app's Documents/{bundle.resolve().name}/ (file sharing is on)")


@click.command(
    "build", short_help="Build a generated app into an .ipa: xcodegen and xcodebuild on macOS, or --virtual anywhere."
)
@click.argument("project", type=click.Path(path_type=Path))
@click.option("--team", default=None, help="Signing team ID (default: $KVRIG_TEAM_ID, then the project's).")
@click.option(
    "-o", "--output", "--out", "output", type=click.Path(path_type=Path), default=None, help="Folder for the .ipa."
)
@click.option(
    "--virtual",
    is_flag=True,
    help="Package for the virtual iPhone instead (any OS): the project's Info.plist, run by the runtime "
    "--app-runtime names.",
)
@click.option(
    "--app-runtime",
    type=click.Choice(["auto", "swift", "python"]),
    default=None,
    help="With --virtual: run the app's Swift engine compiled for this host (`kvrig engine`), kvrig's Python "
    "runtime, or auto: Swift when it can be built here (built now), else Python, as `kvrig demo` chooses "
    "(default: $KVRIG_APP_RUNTIME, else python).",
)
@json_option
def build(
    project: Path, team: str | None, output: Path | None, virtual: bool, app_runtime: str | None, as_json: bool
) -> None:
    """Build a generated project into an .ipa with xcodegen and xcodebuild (macOS only), or with --virtual an
    .ipa the virtual iPhone runs."""
    if virtual:
        from kvrig.appgen.virtual_ipa import APP_RUNTIMES, build_virtual_ipa, default_app_runtime

        runtime = app_runtime or default_app_runtime()
        if runtime == "auto":
            from kvrig.virtual.swiftapp import resolve_runtime

            chosen = resolve_runtime(runtime, on_event=info)
            info(f"app runtime: {chosen.why}")
            runtime = chosen.runtime
        ipa = build_virtual_ipa(project, output, APP_RUNTIMES[runtime])
        if as_json:
            echo_json({"ipa": str(ipa), "virtual": True, "app_runtime": runtime})
        else:
            click.echo(f"built {ipa} (for the virtual iPhone, app runtime: {runtime})")
        return
    from kvrig.appgen.build import build_app

    result = build_app(project, team=team, output=output)
    if as_json:
        echo_json({"ipa": str(result.ipa), "archive": str(result.archive)})
    else:
        click.echo(f"built {result.ipa}")


@click.command(
    "engine",
    short_help="Build the app's engine for this host (Linux, MLX Swift) with its headless runner kvrig-engine.",
)
@click.option(
    "--language-mode",
    type=click.Choice(["5", "6"]),
    default="5",
    show_default=True,
    help="Swift language mode (5: what the Xcode project uses).",
)
@click.option("--release", is_flag=True, help="Optimised build (slower to build, faster to run).")
@click.option(
    "--skip-unresolvable",
    is_flag=True,
    help="Exit 0 with the reason when MLX Swift or a Swift toolchain cannot be resolved here (make test uses "
    "it: the engine tests then skip with that reason). A build that resolved and failed still fails.",
)
@json_option
def engine(language_mode: str, release: bool, skip_unresolvable: bool, as_json: bool) -> None:
    """Build the app's engine for this host (Linux CPU): every App source but the SwiftUI views, Core, and
    the headless runner kvrig-engine, against the pinned MLX Swift packages (resolved by URL or SwiftPM's
    mirrors, or local checkouts in the folder $KVRIG_SWIFT_DEPS names)."""
    from kvrig.appgen.linux import build_and_record
    from kvrig.exceptions import SwiftDepsNotFoundError

    try:
        result = build_and_record(language_mode, configuration="release" if release else "debug")
    except SwiftDepsNotFoundError as exc:
        if not skip_unresolvable:
            raise
        if as_json:
            echo_json({"built": False, "skipped": str(exc), "exit_code": exc.exit_code})
        else:
            click.echo(f"skipped the engine build (the engine tests skip too): {exc}")
        return
    if as_json:
        echo_json(
            {"built": True, "binary": str(result.binary), "language_mode": language_mode, "seconds": result.seconds}
        )
    else:
        click.echo(f"built {result.binary} (Swift {language_mode} mode) in {result.seconds:.0f} s")
