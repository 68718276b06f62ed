"""``mjsched`` / ``python -m mjsched_isolated``: the command line.

This module stays light on purpose: the ``mjsched`` console script imports it, and every spawned worker
re-runs that script's imports, so nothing heavy (SQLAlchemy, Alembic) may load before :func:`main` runs.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command and return its exit code."""
    from mjsched_isolated.cli.app import main as run  # noqa: PLC0415 - heavy imports only when a command runs

    return run(argv)
