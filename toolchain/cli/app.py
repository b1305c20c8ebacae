"""`kvrig app` (generate the Xcode project for a bundle) and `kvrig build` (xcodebuild it on macOS)."""

from __future__ import annotations

from pathlib import Path

import click

from toolchain.cli.render import echo_json, json_option


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
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), required=True, help="Project folder.")
@click.option("--force", is_flag=True, help="Replace the output folder if it holds files.")
@json_option
def app(
    bundle: Path,
    name: str,
    bundle_id: str,
    team: str | None,
    extended_virtual_addressing: bool,
    output: Path,
    force: bool,
    as_json: bool,
) -> None:
    """Generate the MLX-Swift iPhone app (XcodeGen project + Core package) for a bundle."""
    from toolchain.appgen.render import AppOptions, render_app

    options = AppOptions(
        name=name, bundle_id=bundle_id, team=team, extended_virtual_addressing=extended_virtual_addressing
    )
    result = render_app(bundle, output, options, force=force)
    if as_json:
        echo_json({"project": str(result.project), "files": [str(p.relative_to(output)) for p in result.files]})
        return
    click.echo(f"wrote {len(result.files)} files to {result.project}")
    click.echo(f"on a Mac: cd {result.project} && xcodegen generate   (or: kvrig build {result.project})")
    click.echo(f"push the bundle into the app's Documents/{bundle.resolve().name}/ (file sharing is on)")


@click.command("build", short_help="Build a generated app into an .ipa with xcodegen and xcodebuild (macOS only).")
@click.argument("project", type=click.Path(path_type=Path))
@click.option("--team", default=None, help="Signing team ID (default: $KVRIG_TEAM_ID, then the project's).")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None, help="Folder for the .ipa.")
@click.option(
    "--virtual",
    is_flag=True,
    help="Package for the virtual iPhone instead (any OS): the project's Info.plist, run by kvrig's host runtime.",
)
@json_option
def build(project: Path, team: str | None, output: Path | None, virtual: bool, as_json: bool) -> None:
    """Build a generated project into an .ipa with xcodegen and xcodebuild (macOS only), or with --virtual an
    .ipa the virtual iPhone runs."""
    if virtual:
        from toolchain.appgen.virtual_ipa import build_virtual_ipa

        ipa = build_virtual_ipa(project, output / f"{project.name}-virtual.ipa" if output else None)
        if as_json:
            echo_json({"ipa": str(ipa), "virtual": True})
        else:
            click.echo(f"built {ipa} (for the virtual iPhone)")
        return
    from toolchain.appgen.build import build_app

    result = build_app(project, team=team, output=output)
    if as_json:
        echo_json({"ipa": str(result.ipa), "archive": str(result.archive)})
    else:
        click.echo(f"built {result.ipa}")
