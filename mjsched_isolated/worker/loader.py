"""Plugin discovery. **Runs only in worker children**: importing a plugin runs its code.

Two sources, in this order: the built-in plugins shipped in :mod:`mjsched_isolated.plugins` (always), then
a local plugins folder. Every ``*.py`` file whose name does not start with ``_`` is imported; each subclass
of :class:`BaseScheduledJob` defined in it with a non-empty ``job_type`` becomes a job type.

Nothing in a plugins folder can shadow another module: the folder is never put on ``sys.path``. Its files
are imported as submodules of a synthetic package, ``mjsched_plugins`` (``__path__`` = the folder), so a
``queue.py`` there is ``mjsched_plugins.queue`` and the standard library's ``queue`` stays itself. Plugins
share helpers by relative import (``from . import _helpers``, ``from ._helpers import x``); the folder's
``__init__.py``, if any, is not run.

A module that fails to import, or a duplicate ``job_type`` within the local folder, becomes a
:class:`LoadFailure` carrying the traceback; the other modules still load (a bad plugin costs only its own
job type). A local job type with a built-in's name replaces the built-in and adds a line to
``warnings``. An import that has not finished after ``import_timeout_s`` (a plugin hanging at import) is
given up: the module is a failure, its thread is left behind, and the worker serves the other job types. A
module that ends the process while importing is named by the pool (see
:class:`~mjsched_isolated.protocol.Importing`) and left out of later children through ``skip``.

The last good version (``keep_dir``, given by the supervisor's pool): every local module that imports is
copied there, the exact bytes that were run, as ``<keep_dir>/<file name>``, its modification time the
moment the bytes were read (a copy read earlier never replaces one read later, see :func:`keep_copy`).
A local module that later fails to import (a typo saved while ``serve`` runs, whose reload the supervisor
refused; see :mod:`~mjsched_isolated.supervisor.reload`) is imported from that copy instead, under the
same module name, and ``fallbacks`` says so (the pool logs it as an error): a worker refilled after a crash, a
recycle or a kill keeps the job types of the code that last loaded. A file no longer in the folder loses
its copy (a module removed, then added back broken, is a new module). Not covered: a helper module
(``_name.py``) that breaks; an import given up after ``import_timeout_s``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from mjsched_isolated.api import BaseScheduledJob
from mjsched_isolated.keptcopies import keep_copy
from mjsched_isolated.protocol import LoadFailure, PluginInfo

BUILTIN_PACKAGE = "mjsched_isolated.plugins"
LOCAL_PACKAGE = "mjsched_plugins"
DEFAULT_PLUGINS_DIR = "plugins"  # relative to the working directory; used when no folder is configured


class Registry:
    """Job types loaded by :func:`load_plugins`: ``classes`` by job_type, their ``infos``, the
    ``failures`` (modules or folders that cost job types) and ``warnings`` (one line each)."""

    def __init__(self) -> None:
        self.classes: dict[str, type[BaseScheduledJob[Any]]] = {}
        self.infos: list[PluginInfo] = []
        self.failures: list[LoadFailure] = []
        self.warnings: list[str] = []
        self.fallbacks: list[str] = []  # modules that failed and were imported from their last good copy


def builtin_dir() -> Path:
    """The folder of the built-in plugin modules inside the installed package."""
    return Path(__file__).resolve().parent.parent / "plugins"


def load_plugins(plugins_dir: str | Path | None, import_timeout_s: float = 10.0, *, builtins: bool = True,
                 skip: Mapping[str, str] = {}, on_import: Callable[[str], None] | None = None,
                 keep_dir: str | Path | None = None) -> Registry:
    """Load the built-in plugins (unless ``builtins`` is False: tests of one folder) and those of the local
    folder ``plugins_dir``.

    ``plugins_dir`` None: ``./plugins`` if that folder exists, else built-ins only. A folder given
    explicitly that does not exist, is not a folder or cannot be listed is one :class:`LoadFailure` whose
    ``module`` is the folder's path and whose ``error`` names it. ``skip``: module (a local file name, or a
    built-in's dotted name) -> why it is not imported (it becomes a failure with that text). ``on_import``
    is called with the same name just before each import. ``import_timeout_s``: seconds per module.
    ``keep_dir``: the folder of last good copies (module docstring), or None: no copies, no fallback.
    """
    registry = Registry()
    if builtins:
        importlib.import_module(BUILTIN_PACKAGE)
        for path in _plugin_files(builtin_dir()):
            _load_module(registry, f"{BUILTIN_PACKAGE}.{path.stem}", path, f"{BUILTIN_PACKAGE}.{path.stem}",
                         True, import_timeout_s, skip, on_import)
    folder = _local_folder(plugins_dir, registry)
    if folder is None:
        return registry
    try:
        files = _plugin_files(folder)
    except OSError as exc:
        registry.failures.append(LoadFailure(
            module=str(folder), error=f"plugins folder {folder} cannot be read ({exc.strerror or exc})", folder=True))
        return registry
    _mount_local_package(folder)
    keep = Path(keep_dir) if keep_dir is not None else None
    if keep is not None:
        _forget_removed(keep, {path.name for path in files})
    for path in files:
        _load_module(registry, path.name, path, f"{LOCAL_PACKAGE}.{path.stem}", False, import_timeout_s, skip,
                     on_import, keep)
    return registry


def _local_folder(plugins_dir: str | Path | None, registry: Registry) -> Path | None:
    """The local folder to load, or None; records a failure for an explicit folder that is not there."""
    if plugins_dir is None:
        default = Path(DEFAULT_PLUGINS_DIR).resolve()
        return default if default.is_dir() else None
    folder = Path(plugins_dir).resolve()
    if not folder.exists():
        registry.failures.append(LoadFailure(module=str(folder), error=f"plugins folder {folder} does not exist",
                                             folder=True))
        return None
    if not folder.is_dir():
        registry.failures.append(LoadFailure(module=str(folder), error=f"plugins folder {folder} is not a folder",
                                             folder=True))
        return None
    return folder


def _plugin_files(folder: Path) -> list[Path]:
    """The importable plugin files of ``folder``, sorted; raises ``OSError`` if it cannot be listed."""
    with os.scandir(folder) as entries:
        names = [e.name for e in entries if e.name.endswith(".py") and not e.name.startswith("_")]
    return [folder / name for name in sorted(names)]


def _mount_local_package(folder: Path) -> None:
    """Make ``mjsched_plugins`` a package whose ``__path__`` is ``folder`` (replacing an earlier one)."""
    for name in [n for n in sys.modules if n == LOCAL_PACKAGE or n.startswith(LOCAL_PACKAGE + ".")]:
        del sys.modules[name]
    spec = importlib.machinery.ModuleSpec(LOCAL_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    sys.modules[LOCAL_PACKAGE] = importlib.util.module_from_spec(spec)


def _load_module(registry: Registry, key: str, path: Path, name: str, builtin: bool, timeout_s: float,
                 skip: Mapping[str, str], on_import: Callable[[str], None] | None, keep: Path | None = None) -> None:
    """Import one plugin module (``key``: how failures, ``skip`` and ``on_import`` name it) and register
    its job types. ``keep``: the folder of last good copies (local modules only; see the module docstring)."""
    if key in skip:
        registry.failures.append(LoadFailure(module=key, error=skip[key]))
        return
    if on_import is not None:
        on_import(key)
    module, error, timed_out = _import_with_timeout(name, path, timeout_s, keep / path.name if keep else None)
    if module is None and keep is not None and not timed_out and (keep / path.name).is_file():
        module, _, _ = _import_with_timeout(name, keep / path.name, timeout_s)
        if module is not None:
            registry.fallbacks.append(
                f"plugin module {key} no longer imports ({_last_line(error or 'import failed')}); this worker "
                f"imported its last good version instead (the code that last loaded); fix the file and save again")
    if module is None:
        registry.failures.append(LoadFailure(module=key, error=error or "import failed", import_timed_out=timed_out))
        return
    for cls in _job_classes(module):
        _register(registry, cls, key, builtin)


def _register(registry: Registry, cls: type[BaseScheduledJob[Any]], key: str, builtin: bool) -> None:
    job_type = cls.job_type
    info = PluginInfo(job_type=job_type, module=key, description=cls.description, builtin=builtin)
    previous = next((i for i in registry.infos if i.job_type == job_type), None)
    if previous is not None and previous.builtin and not builtin:
        registry.warnings.append(f"plugin {key} overrides the built-in job type {job_type!r} ({previous.module})")
        registry.infos.remove(previous)
    elif previous is not None:
        registry.failures.append(LoadFailure(
            module=key, error=f"duplicate job_type {job_type!r} (already defined by {previous.module})"))
        return
    registry.classes[job_type] = cls
    registry.infos.append(info)


def _import_with_timeout(name: str, path: Path, timeout_s: float,
                         copy_to: Path | None = None) -> tuple[ModuleType | None, str | None, bool]:
    """(module, None, False), (None, traceback text, False), or (None, why, True) when the import was given
    up. The import runs in a daemon thread so a module that never finishes importing cannot hold the worker.
    ``copy_to``: where the source that was run is copied once the import succeeded."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["module"] = _import_path(name, path, copy_to)
        except BaseException:  # noqa: BLE001 - SystemExit in a plugin must not end the child either
            outcome["error"] = traceback.format_exc()

    thread = threading.Thread(target=target, name=f"import-{path.stem}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, f"import did not finish within {timeout_s:g} s (does the module hang at import?)", True
    return outcome.get("module"), outcome.get("error"), False


def _import_path(name: str, path: Path, copy_to: Path | None = None) -> ModuleType:
    """Import the file ``path`` as module ``name`` (its parent package is already in ``sys.modules``).
    ``copy_to``: the bytes run are read once, compiled, and copied there after a successful import."""
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) == str(path):
        return existing  # a built-in imported before in this process: the same classes again
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    source, read_ns = b"", 0
    sys.modules[name] = module  # before running it: msgspec and relative imports look it up there
    try:
        if copy_to is None:
            spec.loader.exec_module(module)
        else:
            read_ns = time.time_ns()  # the copy's version: when its bytes were read (see keep_copy)
            source = path.read_bytes()  # the very bytes run are the ones kept (the file may change meanwhile)
            exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    if copy_to is not None:
        keep_copy(copy_to, source, read_ns)
    return module


def _forget_removed(keep: Path, names: set[str]) -> None:
    """Delete the copies of modules no longer in the plugins folder."""
    try:
        with os.scandir(keep) as entries:
            stale = [e.path for e in entries if e.name.endswith(".py") and e.name not in names]
        for stale_path in stale:
            os.unlink(stale_path)
    except OSError:
        pass


def _last_line(text: str) -> str:
    """The last non-empty line of a traceback (the exception), for one log line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def _job_classes(module: ModuleType) -> list[type[BaseScheduledJob[Any]]]:
    """The job classes ``module`` defines itself (not imports), with a non-empty string ``job_type``."""
    found: list[type[BaseScheduledJob[Any]]] = []
    for _, obj in inspect.getmembers(module, inspect.isclass):
        if not issubclass(obj, BaseScheduledJob) or obj is BaseScheduledJob or obj.__module__ != module.__name__:
            continue
        if isinstance(obj.job_type, str) and obj.job_type:
            found.append(obj)
    return found
