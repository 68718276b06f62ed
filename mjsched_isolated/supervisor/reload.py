"""Plugin reload without a restart: new runs use the plugin code on disk, and a deploy with a typo never
costs a job type.

Three things ask for a reload: a change of the plugin files (the ``*.py`` files of the plugins folder:
name, size, modification time, looked at every ``rescan_interval_s``, like Celery's ``--autoreload`` in
development), a ``mjsched plugins reload`` request (a row in ``plugin_reloads``, read every
``lease_renew_interval_s`` by every supervisor, whatever its machine), and SIGHUP when ``serve`` has no
controlling terminal (see :mod:`~mjsched_isolated.supervisor.loop`).

A reload first *probes* the new code: one extra worker child (a pool of one, outside the pool's slots)
imports the plugins. If a module whose job types the current workers have now fails to import (a syntax
error, a missing dependency), the reload is refused with an error naming the module and the first line
of its error, and the current workers stay: their job types keep running the code they loaded. A worker
refilled meanwhile (a crash, a recycle, a kill at a deadline) imports the module's last good copy, kept by
the pool (:mod:`~mjsched_isolated.worker.loader`), and the pool logs an error saying so. The next
change on disk (or request) tries again. Otherwise the bytes the probe imported become the pool's last good
copies (:meth:`Pool.adopt_good_copies <mjsched_isolated.supervisor.pool.Pool.adopt_good_copies>`: a
broken save right after falls back to them, not to the version before), and :meth:`Pool.replace_all
<mjsched_isolated.supervisor.pool.Pool.replace_all>` replaces every worker once its current run ends.
The probe never blocks the loop: its pipe and sentinel are waited on with the pool's (:meth:`handles`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from mjsched_isolated import protocol
from mjsched_isolated.errors import first_line
from mjsched_isolated.supervisor.pool import Pool

log = logging.getLogger("mjsched.supervisor")

Fingerprint = frozenset[tuple[str, int, int]]


def plugins_folder(plugins_dir: str | None) -> str | None:
    """The folder the workers import local plugins from: ``plugins_dir``, else ``./plugins`` if it exists
    (as :func:`mjsched_isolated.worker.loader.load_plugins`), else None."""
    if plugins_dir is not None:
        return plugins_dir
    return os.path.abspath("plugins") if os.path.isdir("plugins") else None


def fingerprint(folder: str | None) -> Fingerprint:
    """(file name, size, mtime in ns) of every ``*.py`` file of ``folder`` (helpers starting with ``_``
    included: plugins import them). Empty for None or a folder that cannot be read."""
    if folder is None:
        return frozenset()
    try:
        with os.scandir(folder) as entries:
            return frozenset((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries
                             if e.name.endswith(".py") and e.is_file())
    except OSError:
        return frozenset()


class PluginReloader:
    """Watches for reload requests and runs the probe. ``latest_request()`` reads the newest
    ``plugin_reloads`` id (the store's :meth:`~mjsched_isolated.store.Store.latest_plugin_reload`).
    ``check_interval_s``: how often the files are looked at; ``request_interval_s``: how often the
    database is asked. Time is passed in (monotonic seconds)."""

    def __init__(self, pool: Pool, latest_request: Callable[[], int], *, check_interval_s: float,
                 request_interval_s: float) -> None:
        self.pool = pool
        self.latest_request = latest_request
        self.check_interval_s = check_interval_s
        self.request_interval_s = request_interval_s
        self.folder = plugins_folder(getattr(pool, "plugins_dir", None))
        self._files = fingerprint(self.folder)
        self._next_check = 0.0
        self._next_request_read = 0.0
        self._seen_request: int | None = None  # requests made before this supervisor started are not for it
        self._wanted: str | None = None  # why a reload is due (another one while probing: after it)
        self._probe: Pool | None = None
        self._probe_give_up = 0.0
        self.reloads = 0  # reloads done (tests, metrics)
        self.refused = 0

    def request(self, why: str) -> None:
        """Reload as soon as possible (SIGHUP); a probe in progress is followed by another."""
        self._wanted = why

    def step(self, mono: float) -> None:
        """Look for file changes and database requests when due, and start a probe if a reload is wanted.
        Never raises for a database error (the next read tries again)."""
        if mono >= self._next_check:
            self._next_check = mono + self.check_interval_s
            files = fingerprint(self.folder)
            if files != self._files:
                changed = sorted({name for name, *_ in files ^ self._files})
                self._files = files
                self.request(f"plugin files changed: {', '.join(changed)}")
        if mono >= self._next_request_read:
            self._next_request_read = mono + self.request_interval_s
            try:
                latest = self.latest_request()
            except Exception as exc:  # noqa: BLE001 - an outage: the lease code reports it; try again later
                log.debug("reading plugin reload requests failed: %s", first_line(exc))
            else:
                if self._seen_request is not None and latest > self._seen_request:
                    self.request(f"`plugins reload` requested (request {latest})")
                self._seen_request = latest
        if self._wanted is not None and self._probe is None:
            self._start_probe(mono)

    def handles(self) -> list[Any]:
        """The probe's pipe and process sentinel, for the loop's wait (empty without a probe)."""
        if self._probe is None:
            return []
        return [h for w in self._probe.workers.values() if w is not None for h in (w.conn, w.process.sentinel)]

    def poll(self, mono: float) -> None:
        """Read what the probe said (without blocking); decide once it is ready, or give up past its bound."""
        probe = self._probe
        if probe is None:
            return
        events, _ = probe.wait(0)
        ready = next((e.message for e in events if isinstance(e.message, protocol.Ready)), None)
        if ready is not None:
            self._decide(ready, probe)
        elif mono >= self._probe_give_up:
            log.error("plugin reload refused: the new plugin code did not load within %.0f s; the current "
                      "workers stay", self.pool.ready_timeout_s)
            self.refused += 1
            self.pool.reload_event()
            self._end_probe()

    def close(self) -> None:
        if self._probe is not None:
            self._end_probe()

    # -- the probe --------------------------------------------------------------------------------------
    def _start_probe(self, mono: float) -> None:
        why, self._wanted = self._wanted, None
        log.info("plugin reload: %s; loading the new plugin code in a probe worker", why)
        self._probe = Pool(1, self.pool.plugins_dir, log_level=self.pool.log_level,
                           ready_timeout_s=self.pool.ready_timeout_s, import_timeout_s=self.pool.import_timeout_s,
                           log_format=self.pool.log_format, cgroups_mode=self.pool.cgroups_mode,
                           probe=True)  # judges the files on disk: its copies start empty, no fallback
        self._probe_give_up = mono + self.pool.ready_timeout_s * 2
        self._probe.start()

    def _decide(self, ready: protocol.Ready, probe: Pool) -> None:
        current = {p.job_type: p.module for w in self.pool.workers.values()
                   if w is not None and w.ready is not None for p in w.ready.plugins}
        if self.pool.last_ready is not None:
            current.update({p.job_type: p.module for p in self.pool.last_ready.plugins})
        new_types = {p.job_type for p in ready.plugins}
        failed = {f.module: f.error for f in ready.failures}
        lost = {t: m for t, m in current.items() if t not in new_types and m in failed}
        if lost:
            for module in sorted(set(lost.values())):
                types = ", ".join(sorted(t for t, m in lost.items() if m == module))
                log.error("plugin reload refused: plugin module %s no longer imports (%s); the current workers "
                          "stay and keep its job types (%s) running the code they loaded; fix it and save again",
                          module, _last_line(failed[module]), types)
            self.refused += 1
        else:
            self.pool.fatal_modules = dict(probe.fatal_modules)  # a fixed module is imported again
            # the accepted bytes become the last good copies before any worker is replaced: a worker
            # refilled while the next save is broken falls back to this version, not the one before
            self.pool.adopt_good_copies(probe.keep_dir)
            self.pool.replace_all()
            self.reloads += 1
            log.info("plugin reload: every worker is replaced by one with the new plugin code once its run ends "
                     "(job types now: %s)", ", ".join(sorted(new_types)) or "none")
        self.pool.reload_event()
        self._end_probe()

    def _end_probe(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.close(timeout_s=2.0)


def _last_line(text: str) -> str:
    """The last non-empty line of a traceback (the exception), for one log line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
