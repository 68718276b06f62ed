"""loader: plugin discovery from a folder (in-process here; only tests may import plugins this way)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from conftest import FIXTURE_PLUGINS
from mjsched_isolated.api import BaseScheduledJob
from mjsched_isolated.worker.loader import load_plugins
from mjsched_isolated.protocol import LoadFailure, PluginInfo

FIXTURE_TYPES = {"ok", "fail", "boom", "exit", "segv", "sleep", "beat", "hang", "picky", "pollute", "report_state", "gil_hog",
                 "big_details", "fancy_notice", "bad_notice", "leak", "awkward", "leave_behind"}


@pytest.fixture(autouse=True)
def _isolated_imports(monkeypatch):
    """Undo load_plugins' side effects on sys.path and sys.modules after each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("mjsched_plugins.") or name == "_shared":
            del sys.modules[name]


def _write(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def _plugin(job_type: str, cls: str = "P") -> str:
    return textwrap.dedent(f"""
        from mjsched_isolated import BaseScheduledJob, ScheduledJobResult

        class {cls}(BaseScheduledJob):
            job_type = {job_type!r}
            description = "harmless test plugin"

            def execute(self, context):
                return ScheduledJobResult(success=True)
        """)


def test_fixture_plugins_job_types_are_found():
    registry = load_plugins(FIXTURE_PLUGINS)
    assert set(registry.classes) == FIXTURE_TYPES
    assert {i.job_type for i in registry.infos} == FIXTURE_TYPES
    assert all(isinstance(i, PluginInfo) and i.module == "behaviours.py" for i in registry.infos)
    for job_type, cls in registry.classes.items():
        assert issubclass(cls, BaseScheduledJob)
        assert cls.job_type == job_type
    ok = next(i for i in registry.infos if i.job_type == "ok")
    assert ok.description == "succeeds at once and reports when execute began"


def test_fixture_broken_import_is_a_failure_with_traceback():
    registry = load_plugins(FIXTURE_PLUGINS)
    assert [f.module for f in registry.failures] == ["broken_import.py"]
    failure = registry.failures[0]
    assert isinstance(failure, LoadFailure)
    assert "Traceback" in failure.error
    assert "ImportError: this plugin needs a library that is not installed" in failure.error
    assert "never" not in registry.classes
    assert "mjsched_plugins.broken_import" not in sys.modules


def test_duplicate_job_type_is_a_failure_naming_both_modules(tmp_path):
    _write(tmp_path, "alpha.py", _plugin("dup", "A"))
    _write(tmp_path, "beta.py", _plugin("dup", "B"))
    registry = load_plugins(tmp_path)
    assert list(registry.classes) == ["dup"]
    assert registry.classes["dup"].__name__ == "A"  # files load in sorted order; the first wins
    assert [i.module for i in registry.infos] == ["alpha.py"]
    assert len(registry.failures) == 1
    failure = registry.failures[0]
    assert failure.module == "beta.py"
    assert "duplicate job_type 'dup'" in failure.error
    assert "alpha" in failure.error


def test_system_exit_at_import_is_a_failure_not_the_end(tmp_path):
    _write(tmp_path, "exits.py", """
        raise SystemExit(3)
        """)
    _write(tmp_path, "fine.py", _plugin("fine"))
    registry = load_plugins(tmp_path)  # would end the test process if SystemExit escaped
    assert list(registry.classes) == ["fine"]
    assert [f.module for f in registry.failures] == ["exits.py"]
    assert "SystemExit" in registry.failures[0].error


def test_other_exceptions_at_import_are_failures(tmp_path):
    _write(tmp_path, "syntax.py", "def broken(:\n")
    _write(tmp_path, "raises.py", "raise RuntimeError('plugin exploded at import')\n")
    _write(tmp_path, "good.py", _plugin("good"))
    registry = load_plugins(tmp_path)
    assert list(registry.classes) == ["good"]
    failures = {f.module: f.error for f in registry.failures}
    assert set(failures) == {"syntax.py", "raises.py"}
    assert "SyntaxError" in failures["syntax.py"]
    assert "plugin exploded at import" in failures["raises.py"]


def test_underscore_files_and_non_py_files_are_ignored(tmp_path):
    _write(tmp_path, "_helper.py", "raise RuntimeError('must not be imported')\n")
    _write(tmp_path, "__init__.py", "raise RuntimeError('must not be imported either')\n")
    _write(tmp_path, "notes.txt", "not python\n")
    _write(tmp_path, "real.py", _plugin("real"))
    registry = load_plugins(tmp_path)
    assert list(registry.classes) == ["real"]
    assert registry.failures == []
    assert "mjsched_plugins._helper" not in sys.modules


def test_plugins_may_import_helpers_from_their_folder(tmp_path):
    _write(tmp_path, "_shared.py", "VALUE = 'from-helper'\n")
    _write(tmp_path, "uses_helper.py", _plugin("uses") + "\nimport _shared\nDESCRIPTION = _shared.VALUE\n")
    registry = load_plugins(tmp_path)
    assert registry.failures == []
    assert list(registry.classes) == ["uses"]
    assert sys.modules[registry.classes["uses"].__module__].DESCRIPTION == "from-helper"


def test_classes_without_job_type_or_imported_from_elsewhere_are_skipped(tmp_path):
    _write(tmp_path, "mixed.py", """
        from mjsched_isolated import BaseScheduledJob

        class Abstract(BaseScheduledJob):
            pass  # no job_type

        class NotAString(BaseScheduledJob):
            job_type = 42

        class NotAJob:
            job_type = "nope"

        class Real(Abstract):
            job_type = "real"
        """)
    registry = load_plugins(tmp_path)
    assert list(registry.classes) == ["real"]
    assert registry.failures == []


def test_missing_folder_gives_empty_registry_and_says_so(tmp_path):
    registry = load_plugins(tmp_path / "does-not-exist")
    assert registry.classes == {}
    assert registry.infos == []
    assert len(registry.failures) == 1 and "does not exist" in registry.failures[0].error


def test_a_file_is_not_a_folder(tmp_path):
    path = _write(tmp_path, "single.py", _plugin("single"))
    registry = load_plugins(path)
    assert registry.classes == {} and "does not exist" in registry.failures[0].error


def test_empty_folder_gives_empty_registry(tmp_path):
    registry = load_plugins(tmp_path)
    assert (registry.classes, registry.infos, registry.failures) == ({}, [], [])
