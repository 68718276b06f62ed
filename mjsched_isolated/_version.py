"""The package version: one source, the installed distribution's metadata (``pyproject.toml``)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__: str = version("mjsched_isolated")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0.0.0+unknown"
