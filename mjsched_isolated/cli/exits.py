"""The CLI's exit codes, in one place (documented in ``mjsched --help``)."""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    """``OK`` all is well; ``FAILED`` a run failed, was refused, or a check found problems; ``BAD_INPUT``
    one line naming the field, nothing written; ``INTERRUPTED`` Ctrl-C (128 + SIGINT); ``TERMINATED`` SIGTERM
    during ``jobs run`` (128 + SIGTERM)."""

    OK = 0
    FAILED = 1
    BAD_INPUT = 2
    INTERRUPTED = 130
    TERMINATED = 143
