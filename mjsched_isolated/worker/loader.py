"""Plugin discovery. **Runs only in worker children**: importing a plugin runs its code.

Every ``*.py`` file in the plugins folder whose name does not start with ``_`` is imported by path (as
module ``mjsched_plugins.<stem>``, with the folder on ``sys.path`` so plugins may import helpers). Each
subclass of :class:`BaseScheduledJob` defined in it with a non-empty ``job_type`` becomes a job type. A
module that fails to import, or a duplicate ``job_type``, becomes a :class:`LoadFailure` carrying the
traceback; the other modules still load (a bad plugin costs only its own job type). An import that
has not finished after ``import_timeout_s`` (a plugin hanging at import) is given up: the module is a
failure, its thread is left behind, and the worker serves the other job types. A module that ends the
process while importing is named by the pool (see :class:`~mjsched_isolated.protocol.Importing`) and
left out of later children through ``skip``.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable, Mapping

from mjsched_isolated.api import BaseScheduledJob
from mjsched_isolated.protocol import LoadFailure, PluginInfo


class Registry:
    """Job types loaded from one plugins folder: ``classes`` by job_type, plus ``failures``."""

    def __init__(self) -> None:
        self.classes: dict[str, type[BaseScheduledJob]] = {}
        self.infos: list[PluginInfo] = []
        self.failures: list[LoadFailure] = []


def load_plugins(plugins_dir: str | Path, import_timeout_s: float = 10.0, *, skip: Mapping[str, str] = {},
                 on_import: Callable[[str], None] | None = None) -> Registry:
    """Import every plugin module in ``plugins_dir``. A missing folder yields an empty registry with one
    failure saying so. ``skip``: module file name -> why it is not imported (it becomes a failure with
    that text). ``on_import(file name)`` is called just before each import."""
    registry = Registry()
    folder = Path(plugins_dir).resolve()
    if not folder.is_dir():
        registry.failures.append(LoadFailure(module=str(folder), error=f"plugins folder {folder} does not exist"))
        return registry
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        if path.name in skip:
            registry.failures.append(LoadFailure(module=path.name, error=skip[path.name]))
            continue
        if on_import is not None:
            on_import(path.name)
        module, error, timed_out = _import_with_timeout(path, import_timeout_s)
        if error is not None:
            registry.failures.append(LoadFailure(module=path.name, error=error, import_timed_out=timed_out))
            continue
        for cls in _job_classes(module):
            if cls.job_type in registry.classes:
                other = registry.classes[cls.job_type].__module__
                registry.failures.append(
                    LoadFailure(module=path.name, error=f"duplicate job_type {cls.job_type!r} (already defined by {other})")
                )
                continue
            registry.classes[cls.job_type] = cls
            registry.infos.append(PluginInfo(job_type=cls.job_type, module=path.name, description=cls.description))
    return registry


def _import_with_timeout(path: Path, timeout_s: float):
    """(module, None, False), (None, traceback text, False), or (None, why, True) when the import was given
    up. The import runs in a daemon thread so a module that never finishes importing cannot hold the worker."""
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["module"] = _import_path(path)
        except BaseException:  # noqa: BLE001 - SystemExit in a plugin must not end the child either
            outcome["error"] = traceback.format_exc()

    thread = threading.Thread(target=target, name=f"import-{path.stem}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, f"import did not finish within {timeout_s:g} s (does the module hang at import?)", True
    return outcome.get("module"), outcome.get("error"), False


def _import_path(path: Path):
    name = f"mjsched_plugins.{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _job_classes(module) -> list[type[BaseScheduledJob]]:
    found = []
    for _, obj in inspect.getmembers(module, inspect.isclass):
        if issubclass(obj, BaseScheduledJob) and obj is not BaseScheduledJob and obj.__module__ == module.__name__:
            if isinstance(obj.job_type, str) and obj.job_type:
                found.append(obj)
    return found
