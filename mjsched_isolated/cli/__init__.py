"""``mjsched`` / ``python -m mjsched_isolated``: the command line.

This module stays light on purpose: the ``mjsched`` console script imports it, and every spawned worker
re-runs that script's imports, so nothing heavy (SQLAlchemy, Alembic) may load before :func:`main` runs.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command and return its exit code."""
    import sys  # noqa: PLC0415 - loaded only where needed

    if (sys.argv[1:] if argv is None else argv) == ["--version"]:  # answered without the heavy imports
        from mjsched_isolated._version import __version__  # noqa: PLC0415 - loaded only where needed

        print(f"mjsched {__version__}")
        return 0
    from mjsched_isolated.cli.app import main as run  # noqa: PLC0415 - loaded only where needed

    return run(argv)
