"""The kvrig release (kept apart so that no module has to import the package root for it)."""

__version__ = "0.1.0"

# The packages whose versions decide what kvrig does (bytes, caches, wire formats).
DEPENDENCIES = ("mlx", "mlx-lm", "pymobiledevice3", "coremltools")


def dependency_versions() -> dict[str, str | None]:
    """kvrig's, Python's and each dependency's version (None: not installed), read from package metadata so
    that none of them is imported."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    def one(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"kvrig": __version__, "python": sys.version.split()[0], **{name: one(name) for name in DEPENDENCIES}}
