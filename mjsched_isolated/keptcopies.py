"""The last good copies of plugin modules, shared by the worker's loader (which keeps what it imported) and
the supervisor's pool (which adopts what an accepted reload's probe imported): a neutral module, so that
the supervisor never imports the loader (tests/test_import_contract.py)."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def keep_copy(target: Path, source: bytes, read_ns: int) -> bool:
    """Write ``source``, read from the plugin file at ``read_ns`` (wall clock, ns), to ``target`` atomically
    (workers starting together may write the same file), its modification time set to ``read_ns``: the copy's
    version. A copy read later is never replaced by one read earlier (a worker that read the file before a
    reload was accepted and finishes its import after the accepted version was kept, see
    :meth:`~mjsched_isolated.supervisor.pool.Pool.adopt_good_copies`). Returns whether ``target`` holds
    ``source`` now. A failure only costs the fallback."""
    try:
        try:
            kept = target.stat().st_mtime_ns
        except FileNotFoundError:
            kept = None
        if kept is not None and kept >= read_ns:
            return False  # a newer version is kept already
        if kept is not None and target.read_bytes() == source:
            os.utime(target, ns=(read_ns, read_ns))
            return True
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_bytes(source)
        os.utime(temporary, ns=(read_ns, read_ns))
        os.replace(temporary, target)
        return True
    except OSError:
        return False
