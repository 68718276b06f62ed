"""The process boundary in the import graph: the worker side never imports the store, SQLAlchemy, Alembic
or the supervisor, and the supervisor side never imports plugins or the plugin loader.

Checked statically (an AST walk over the modules and everything of ours they import, package
``__init__`` files included) and at run time: a fixture plugin reports ``sys.modules`` from inside a worker
started by the installed ``mjsched`` console script and by ``python -m mjsched_isolated``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import FIXTURE_PLUGINS, add_job

from mjsched_isolated.store import Store

PACKAGE = Path(__file__).resolve().parents[1] / "mjsched_isolated"
# what worker-side code may import besides the standard library (issue 10, "worker/")
WORKER_ALLOWED_OURS = {"mjsched_isolated", "mjsched_isolated._version", "mjsched_isolated.api",
                       "mjsched_isolated.protocol", "mjsched_isolated.errors", "mjsched_isolated.logs",
                       "mjsched_isolated.enums", "mjsched_isolated.proctree", "mjsched_isolated.cgroups",
                       "mjsched_isolated.keptcopies"}
WORKER_ALLOWED_THIRD_PARTY = {"msgspec", "psutil"}
HEAVY = ("sqlalchemy", "alembic", "mako")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _path_of(module: str) -> Path | None:
    base = PACKAGE.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    """Absolute module names ``path`` imports, at any depth (lazy imports in functions count), except those
    under ``if TYPE_CHECKING:``. ``from pkg import name`` counts as ``pkg.name`` when that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the project's imports are absolute)"
            assert node.module is not None
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if _path_of(f"{node.module}.{a.name}"))
    return found


def _closure(start: list[Path]) -> dict[str, set[str]]:
    """module -> its imports, for ``start`` and every module of ours reachable from it (with the package
    ``__init__`` files an import runs)."""
    graph: dict[str, set[str]] = {}
    todo = [_module_name(p) for p in start]
    while todo:
        module = todo.pop()
        if module in graph:
            continue
        path = _path_of(module)
        assert path is not None, module
        graph[module] = _imports(path)
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        for name in graph[module] | set(parents):
            if name.split(".")[0] == "mjsched_isolated" and name not in graph:
                todo.append(name)
    return graph


PROBE_PREFIX = "_contract_probe"


def _worker_side() -> list[Path]:
    # without the probe :func:`test_the_contract_checker_sees_a_violation` writes there for a moment (another
    # xdist worker may be walking the folder at that instant)
    return [*sorted(p for p in (PACKAGE / "worker").glob("*.py") if not p.name.startswith(PROBE_PREFIX)),
            PACKAGE / "api.py", PACKAGE / "protocol.py"]


def test_the_worker_side_imports_only_the_protocol_the_plugin_api_and_the_standard_library():
    graph = _closure(_worker_side())
    ours = {m for m in graph if not m.startswith("mjsched_isolated.worker")}
    assert ours <= WORKER_ALLOWED_OURS, f"worker side reaches {sorted(ours - WORKER_ALLOWED_OURS)}"
    wrong = {}
    for module, imports in graph.items():
        for name in imports:
            top = name.split(".")[0]
            if top == "mjsched_isolated":
                if not (name in WORKER_ALLOWED_OURS or name.startswith("mjsched_isolated.worker")):
                    wrong.setdefault(module, []).append(name)
            elif top not in sys.stdlib_module_names and top not in WORKER_ALLOWED_THIRD_PARTY:
                wrong.setdefault(module, []).append(name)
    assert wrong == {}


def test_the_contract_checker_sees_a_violation(tmp_path):
    """The walk above must be able to fail: a lazy import of the store, in a function, is found."""
    probe = PACKAGE / "worker" / f"{PROBE_PREFIX}{os.getpid()}.py"
    probe.write_text("def f():\n    from mjsched_isolated.store import facade\n    import sqlalchemy\n")
    try:
        graph = _closure([probe])
    finally:
        probe.unlink()
    assert {"mjsched_isolated.store.facade", "sqlalchemy"} <= graph[f"mjsched_isolated.worker.{probe.stem}"]
    assert "mjsched_isolated.store" in graph  # followed into the store


@pytest.mark.parametrize("side", ["supervisor", "store"])
def test_the_supervisor_and_the_store_never_import_plugins_or_the_loader(side):
    for path in sorted((PACKAGE / side).rglob("*.py")):
        for name in _imports(path):
            assert not name.startswith(("mjsched_isolated.plugins", "mjsched_plugins", "mjsched_isolated.worker.loader",
                                        "mjsched_isolated.worker.execute")), f"{path} imports {name}"


def _fresh_modules(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return set(json.loads(out))


def test_importing_the_worker_package_loads_no_database_code():
    modules = _fresh_modules("import mjsched_isolated.worker.main")
    assert not {m for m in modules if m.split(".")[0] in HEAVY}
    assert "mjsched_isolated.worker.loader" not in modules  # the spawn target does not load the loader ...
    assert not {m for m in modules if m.startswith("mjsched_isolated.plugins.")}  # ... nor any plugin


def test_the_pool_does_not_load_the_loader_or_plugins_into_the_supervisor():
    modules = _fresh_modules("import mjsched_isolated.supervisor.pool")
    assert not {m for m in modules if m.startswith(("mjsched_isolated.worker.loader", "mjsched_isolated.plugins.",
                                                     "mjsched_plugins"))}


# -- at run time, inside real workers ----------------------------------------------------------------------


def _launchers() -> dict[str, list[str]]:
    script = Path(sys.executable).parent / "mjsched"
    assert script.is_file(), f"the console script {script} is not installed (pip install -e .)"
    return {"console script": [str(script)], "python -m": [sys.executable, "-m", "mjsched_isolated"]}


def _cli(launcher: list[str], tmp_path: Path, *args: str,
         plugins: str = FIXTURE_PLUGINS) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MJSCHED_")}
    env.update(MJSCHED_DATABASE_URL=f"sqlite:///{tmp_path / 'm.db'}", MJSCHED_PLUGINS_DIR=plugins)
    return subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
                          check=False)


def _run_json(launcher: list[str], tmp_path: Path, job_type: str, plugins: str = FIXTURE_PLUGINS) -> tuple[dict, str]:
    """``jobs run NAME --json`` of a new job of ``job_type`` (added in-process: only the run is the point)."""
    name = f"j-{job_type}-{uuid.uuid4().hex[:8]}"
    store = Store.open(f"sqlite:///{tmp_path / 'm.db'}")
    try:
        add_job(store, name, job_type, "0 0 1 1 *")
    finally:
        store.close()
    proc = _cli(launcher, tmp_path, "jobs", "run", name, "--json", plugins=plugins)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    run = json.loads(proc.stdout)  # the whole of stdout is the JSON document
    details = run["details"]
    return (json.loads(details) if isinstance(details, str) else details), proc.stderr


def test_workers_under_both_launchers_hold_no_database_code_and_the_same_memory(tmp_path):
    """Issue 10's done-when: a worker started by the ``mjsched`` console script was 57 MB with 570 modules
    against 21 MB with 213 under ``python -m`` (spawn re-ran the script's heavy import). Now the two
    must hold the same modules (give or take the launcher's own) and be within 10 % in RSS."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "worker_facts.py").write_text((Path(FIXTURE_PLUGINS) / "worker_facts.py").read_text())
    facts = {}
    for label, launcher in _launchers().items():
        facts[label] = _run_json(launcher, tmp_path, "report_modules", plugins=str(plugins))[0]
    for label, details in facts.items():
        heavy = [m for m in details["modules"] if m.split(".")[0] in HEAVY]
        assert heavy == [], f"{label}: {heavy[:5]}"
        assert "mjsched_isolated.store" not in details["modules"]
        assert "mjsched_isolated.supervisor" not in details["modules"]
    script, module = facts["console script"], facts["python -m"]
    for details in (script, module):  # spawn ran the worker's own entry as its main, not the launcher's
        assert details["main"].endswith(os.path.join("worker", "main.py")), details["main"]
    assert abs(len(script["modules"]) - len(module["modules"])) <= 5, (len(script["modules"]), len(module["modules"]))
    assert abs(script["rss_bytes"] - module["rss_bytes"]) <= 0.10 * module["rss_bytes"], (script["rss_bytes"],
                                                                                          module["rss_bytes"])
    print(f"worker RSS: console script {script['rss_bytes'] / 1e6:.1f} MB, {len(script['modules'])} modules; "
          f"python -m {module['rss_bytes'] / 1e6:.1f} MB, {len(module['modules'])} modules")


def test_a_plugin_printing_to_stdout_leaves_jobs_run_json_clean(tmp_path):
    """print(), os.write(1, ...) and a subprocess inheriting fd 1 all land in the run's output (the
    worker's fds 1 and 2 are its capture pipe), neither in the JSON nor on stderr."""
    details, stderr = _run_json(_launchers()["python -m"], tmp_path, "print_stdout")
    assert details == {"printed": True}
    store = Store.open(f"sqlite:///{tmp_path / 'm.db'}")
    try:
        output = "".join(text for _, text in store.run_output(store.list_runs(limit=1)[0]["id"]))
    finally:
        store.close()
    for text in ("PLUGIN-PRINT", "PLUGIN-FD1", "PLUGIN-SUBPROCESS"):
        assert text in output and text not in stderr  # not lost: stored with the run


APPLICATION = """
import sqlalchemy  # the application's own heavy import, at the top level, and no __main__ guard
from mjsched_isolated import Client

print("application top level ran")
client = Client({url!r}, plugins_dir={plugins!r})
client.add_job("facts", job_type="report_modules", cron_expression="0 0 1 1 *")
print("RESULT", json.dumps(client.get_run(client.run_job("facts")).details))
"""


def test_workers_of_an_application_using_the_client_never_rerun_its_main_module(tmp_path):
    """Spawn re-runs the parent's main module in every child: an application calling ``Client.run_job``
    at top level (no ``if __name__ == "__main__"`` guard) crashed with multiprocessing's bootstrapping
    error, and a guarded one dragged all its imports (SQLAlchemy) into every worker. The worker runs its
    own entry module as main instead: the application's code runs once, its imports stay out."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "worker_facts.py").write_text((Path(FIXTURE_PLUGINS) / "worker_facts.py").read_text())
    script = tmp_path / "app.py"
    script.write_text("import json\n" + APPLICATION.format(url=f"sqlite:///{tmp_path / 'app.db'}",
                                                           plugins=str(plugins)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50, check=False,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("application top level ran") == 1, proc.stdout
    details = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert not [m for m in details["modules"] if m.split(".")[0] in HEAVY]
    assert details["main"].endswith(os.path.join("worker", "main.py"))
