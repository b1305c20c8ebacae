"""Adapters for the private names of dependencies that kvrig cannot avoid: one module per name.

Each module wraps one private name, says which distribution declares it (`DISTRIBUTION`) and the version
range it was tested with (`TESTED`, the same range pyproject.toml pins); tests/test_compat.py checks both and
that nothing else in the package imports a dependency's private name.
"""
