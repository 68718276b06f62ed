"""loader: plugin discovery from the built-ins and a folder (in-process here; only tests may import plugins
this way), plus the shadowing and built-in tests that need a real worker."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import FIXTURE_PLUGINS
from worker_helpers import OneWorker

from mjsched_isolated.api import BaseScheduledJob
from mjsched_isolated.protocol import LoadFailure, PluginInfo
from mjsched_isolated.worker.loader import load_plugins

BEHAVIOUR_TYPES = {"ok", "fail", "forge", "boom", "exit", "segv", "sleep", "beat", "watch_deadline", "sleep_then_mark",
                   "hang", "picky", "pollute", "report_state", "gil_hog", "big_details", "fancy_notice", "bad_notice",
                   "leak", "awkward", "leave_behind", "burn", "flaky"}
WORKER_FACT_TYPES = {"report_modules", "print_stdout", "async_beat"}
FIXTURE_TYPES = BEHAVIOUR_TYPES | WORKER_FACT_TYPES
OVERRIDE_WARNING = "plugin my_shell.py overrides the built-in job type 'shell' (mjsched_isolated.plugins.shell)"
OVERRIDE_WARNING = "plugin my_shell.py overrides the built-in job type 'shell' (mjsched_isolated.plugins.shell)"
BUILTIN_TYPES = {"shell", "http_check", "file_retention", "sqlite_backup", "python_callable", "steps"}


@pytest.fixture(autouse=True)
def _isolated_imports(monkeypatch):
    """Undo load_plugins' side effects on sys.path and sys.modules after each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("mjsched_plugins"):
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
    registry = load_plugins(FIXTURE_PLUGINS, builtins=False)
    assert set(registry.classes) == FIXTURE_TYPES
    assert {i.job_type for i in registry.infos} == FIXTURE_TYPES
    assert all(isinstance(i, PluginInfo) and not i.builtin for i in registry.infos)
    assert {i.job_type for i in registry.infos if i.module == "behaviours.py"} == BEHAVIOUR_TYPES
    for job_type, cls in registry.classes.items():
        assert issubclass(cls, BaseScheduledJob)
        assert cls.job_type == job_type
    ok = next(i for i in registry.infos if i.job_type == "ok")
    assert ok.description == "succeeds at once and reports when execute began"


def test_fixture_broken_import_is_a_failure_with_traceback():
    registry = load_plugins(FIXTURE_PLUGINS, builtins=False)
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
    registry = load_plugins(tmp_path, builtins=False)
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
    registry = load_plugins(tmp_path, builtins=False)  # would end the test process if SystemExit escaped
    assert list(registry.classes) == ["fine"]
    assert [f.module for f in registry.failures] == ["exits.py"]
    assert "SystemExit" in registry.failures[0].error


def test_other_exceptions_at_import_are_failures(tmp_path):
    _write(tmp_path, "syntax.py", "def broken(:\n")
    _write(tmp_path, "raises.py", "raise RuntimeError('plugin exploded at import')\n")
    _write(tmp_path, "good.py", _plugin("good"))
    registry = load_plugins(tmp_path, builtins=False)
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
    registry = load_plugins(tmp_path, builtins=False)
    assert list(registry.classes) == ["real"]
    assert registry.failures == []
    assert "mjsched_plugins._helper" not in sys.modules


def test_plugins_share_helpers_by_relative_import(tmp_path):
    _write(tmp_path, "_shared.py", "VALUE = 'from-helper'\n")
    _write(tmp_path, "uses_helper.py", _plugin("uses") + "\nfrom . import _shared\nfrom ._shared import VALUE\n"
                                                         "DESCRIPTION = _shared.VALUE + '/' + VALUE\n")
    registry = load_plugins(tmp_path, builtins=False)
    assert registry.failures == []
    assert list(registry.classes) == ["uses"]
    module = sys.modules[registry.classes["uses"].__module__]
    assert module.__name__ == "mjsched_plugins.uses_helper"
    assert module.DESCRIPTION == "from-helper/from-helper"
    assert str(tmp_path) not in sys.path  # the folder is never on sys.path: nothing in it shadows anything


def test_a_plugin_file_named_like_a_stdlib_module_shadows_nothing(tmp_path):
    _write(tmp_path, "queue.py", _plugin("user_queue"))
    _write(tmp_path, "json.py", "raise RuntimeError('a broken json.py must cost only itself')\n")
    _write(tmp_path, "threads.py", _plugin("threads") + textwrap.dedent("""
        import json
        import queue
        from concurrent.futures import ThreadPoolExecutor
        assert hasattr(queue, "SimpleQueue") and hasattr(json, "dumps")
        """))
    registry = load_plugins(tmp_path, builtins=False)
    assert set(registry.classes) == {"user_queue", "threads"}
    assert [f.module for f in registry.failures] == ["json.py"]
    assert not registry.failures[0].folder  # a module's failure, not the folder's
    assert sys.modules["mjsched_plugins.queue"] is not sys.modules["queue"]


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
    registry = load_plugins(tmp_path, builtins=False)
    assert list(registry.classes) == ["real"]
    assert registry.failures == []


def test_missing_folder_gives_empty_registry_and_says_so(tmp_path):
    registry = load_plugins(tmp_path / "does-not-exist", builtins=False)
    assert registry.classes == {}
    assert registry.infos == []
    assert registry.failures == [LoadFailure(module=str(tmp_path / "does-not-exist"),
                                             error=f"plugins folder {tmp_path / 'does-not-exist'} does not exist",
                                             folder=True)]


def test_a_missing_explicit_folder_still_leaves_the_builtins(tmp_path):
    registry = load_plugins(tmp_path / "nope")
    assert set(registry.classes) == BUILTIN_TYPES
    assert [f.module for f in registry.failures] == [str(tmp_path / "nope")]


def test_a_file_is_not_a_folder(tmp_path):
    path = _write(tmp_path, "single.py", _plugin("single"))
    registry = load_plugins(path, builtins=False)
    assert registry.classes == {} and registry.failures[0].error == f"plugins folder {path} is not a folder"
    assert registry.failures[0].folder


DROP_CAPABILITIES = """
import ctypes
header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty
assert ctypes.CDLL(None, use_errno=True).capset(header, data) == 0, ctypes.get_errno()
"""


def test_an_unreadable_folder_is_a_failure_naming_it(tmp_path):
    """The loading process drops its capabilities first: as root (CAP_DAC_OVERRIDE) it would read a
    mode-000 folder anyway."""
    folder = tmp_path / "locked"
    folder.mkdir()
    _write(folder, "p.py", _plugin("p"))
    folder.chmod(0)
    script = DROP_CAPABILITIES + textwrap.dedent("""
        import json, sys
        from mjsched_isolated.worker.loader import load_plugins
        r = load_plugins(sys.argv[1])
        print(json.dumps([sorted(r.classes), [f.error for f in r.failures if f.folder]]))
        """)
    try:
        proc = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=30,
                              check=False)
    finally:
        folder.chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    classes, errors = json.loads(proc.stdout)
    assert classes == sorted(BUILTIN_TYPES)
    assert errors == [f"plugins folder {folder} cannot be read (Permission denied)"]


def test_builtins_load_without_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./plugins here
    registry = load_plugins(None)
    assert set(registry.classes) == BUILTIN_TYPES
    assert registry.failures == [] and registry.warnings == []
    assert all(i.builtin and i.module == f"mjsched_isolated.plugins.{i.job_type}" for i in registry.infos)


def test_none_means_the_plugins_folder_of_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "plugins").mkdir()
    _write(tmp_path / "plugins", "mine.py", _plugin("mine"))
    monkeypatch.chdir(tmp_path)
    registry = load_plugins(None)
    assert set(registry.classes) == BUILTIN_TYPES | {"mine"}
    assert [i.module for i in registry.infos if not i.builtin] == ["mine.py"]


def test_a_local_plugin_overrides_a_builtin_with_a_warning(tmp_path):
    _write(tmp_path, "my_shell.py", _plugin("shell", "MyShell"))
    registry = load_plugins(tmp_path)
    assert registry.classes["shell"].__name__ == "MyShell"
    assert registry.failures == []
    assert registry.warnings == [OVERRIDE_WARNING]
    assert [i.module for i in registry.infos if i.job_type == "shell"] == ["my_shell.py"]


def test_empty_folder_gives_empty_registry(tmp_path):
    registry = load_plugins(tmp_path, builtins=False)
    assert (registry.classes, registry.infos, registry.failures) == ({}, [], [])


# -- in a real worker: nothing in the folder shadows the standard library -----------------------------------

THREAD_POOL_PLUGIN = '''
from concurrent.futures import ThreadPoolExecutor

from mjsched_isolated import BaseScheduledJob, ScheduledJobResult


class Threads(BaseScheduledJob):
    job_type = "threads"

    def execute(self, context):
        with ThreadPoolExecutor(2) as pool:
            return ScheduledJobResult(success=True, details={"squares": list(pool.map(lambda x: x * x, [2, 3]))})
'''


def test_user_queue_and_sqlite3_files_break_neither_a_thread_pool_nor_sqlite_backup(tmp_path):
    """The issue's two reports, in a real worker child: a user ``queue.py`` broke a thread-pool plugin, a
    helper ``sqlite3.py`` broke the shipped sqlite_backup. Both files here are broken on purpose."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    _write(plugins, "queue.py", "raise RuntimeError('user queue.py imported in place of the stdlib')\n")
    _write(plugins, "sqlite3.py", "raise RuntimeError('user sqlite3.py imported in place of the stdlib')\n")
    _write(plugins, "threads.py", THREAD_POOL_PLUGIN)
    source = tmp_path / "data.db"
    with sqlite3.connect(source) as conn:
        conn.execute("CREATE TABLE t (x)")
    with OneWorker(str(plugins)) as worker:
        assert {f.module for f in worker.ready.failures} == {"queue.py", "sqlite3.py"}  # they cost only themselves
        assert {"threads", "sqlite_backup"} <= {p.job_type for p in worker.ready.plugins}
        threads = worker.run("threads")[-1]
        backup = worker.run("sqlite_backup", json.dumps({"database": str(source),
                                                          "destination_dir": str(tmp_path / "backups")}))[-1]
    assert (threads.success, threads.details["squares"]) == (True, [4, 9]), threads.error_message
    assert backup.success, backup.error_message
    assert len(list((tmp_path / "backups").iterdir())) == 1


def test_an_override_warning_travels_in_ready(tmp_path):
    _write(tmp_path, "my_shell.py", _plugin("shell", "MyShell"))
    with OneWorker(str(tmp_path)) as worker:
        assert worker.ready.warnings == [OVERRIDE_WARNING]
        assert worker.ready.failures == []
        finished = worker.run("shell", '{"command": ["false"]}')[-1]
    assert finished.success  # the override ran (the built-in would have failed with exit code 1)
