"""`kvrig verify`: re-check every bundle file against its manifest."""

from __future__ import annotations

from pathlib import Path

import click

from kvrig.cli.render import echo_json, json_option


@click.command("verify", short_help="Re-check every bundle file against its manifest.")
@click.argument("bundle", type=click.Path(path_type=Path))
@json_option
def verify(bundle: Path, as_json: bool) -> None:
    """Check that every file of BUNDLE is present with the size and sha256 its manifest lists."""
    from kvrig.bundle.manifest import check_bundle

    result = check_bundle(bundle)
    if as_json:
        echo_json(
            {
                "bundle": str(result.bundle),
                "ok": result.ok,
                "checked": result.checked,
                "problems": [{"path": p.path, "problem": p.problem} for p in result.problems],
            }
        )
    if not result.ok:
        raise result.error()
    if not as_json:
        click.echo(f"{bundle}: OK, {result.checked} files match the manifest")
