"""The suite's parallel run (tests/parallel.py), under a real pytest with two xdist workers: an ``alone`` test
never overlaps another test (without the plugin the same two tests do overlap: the check can fail), and the
``serial`` group runs on one worker (pytest-xdist's loadgroup; pytest 9.2 broke it, pytest-xdist issue 1386)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent

# Two tests, one per worker. Each marks its start, waits (bounded) for the other's start, and fails if the
# other has started and not yet ended: they overlapped. Run one after the other, the first waits out
# OTHER_WAIT_S and the second sees the first ended.
INNER = '''
import os, time
from pathlib import Path

import pytest
from waiting import wait_until

SHARED = Path(os.environ["INNER_SHARED"])


def meet(me, other):
    (SHARED / f"{me}.start").touch()
    try:
        wait_until(lambda: (SHARED / f"{other}.start").exists(), float(os.environ["OTHER_WAIT_S"]), "", interval_s=0.02)
    except pytest.fail.Exception:
        pass  # the other one has not started: it runs after this one
    overlapped = (SHARED / f"{other}.start").exists() and not (SHARED / f"{other}.end").exists()
    (SHARED / f"{me}.end").touch()
    assert not overlapped, f"{me} overlapped {other}"


def worker(name):
    (SHARED / f"{name}.worker").write_text(os.environ["PYTEST_XDIST_WORKER"])


def test_ordinary():
    meet("ordinary", "alone")


@pytest.mark.alone
def test_alone():
    worker("alone")
    meet("alone", "ordinary")


@pytest.mark.xdist_group("serial")
@pytest.mark.parametrize("i", range(3))
def test_serial(i):
    worker(f"serial-{i}")
'''


def _inner_pytest(tmp_path: Path, args: list[str], other_wait_s: float) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 40\n")  # none of the project's addopts
    (tmp_path / "test_inner.py").write_text(INNER)
    shared = tmp_path / "shared"
    shared.mkdir()
    # only the plugins the inner run needs: the installed ones (hypothesis, schemathesis, ...) would multiply
    # its start-up, in the runner and in each of its two workers (4-5x on a loaded machine)
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR), "INNER_SHARED": str(shared), "OTHER_WAIT_S": str(other_wait_s),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "xdist.plugin",
                           "-p", "pytest_timeout", *args, "-n", "2",
                           "--dist", "loadgroup", "--basetemp", str(tmp_path / "basetemp"), "test_inner.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50, check=False)


@pytest.mark.timeout(60)
def test_an_alone_test_runs_while_no_other_test_runs_and_the_serial_group_on_one_worker(tmp_path):
    proc = _inner_pytest(tmp_path, ["-p", "parallel"], other_wait_s=1.0)
    assert proc.returncode == 0 and "5 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    workers = {path.stem: path.read_text() for path in (tmp_path / "shared").glob("*.worker")}
    assert len(workers) == 4 and len(set(workers.values())) == 1, workers  # the alone test is in the group too


@pytest.mark.timeout(60)
def test_without_the_plugin_the_two_tests_overlap(tmp_path):
    """The check above has teeth: the same two tests, started together on two workers, see each other."""
    proc = _inner_pytest(tmp_path, ["-k", "ordinary or alone"], other_wait_s=20.0)  # they meet at once
    # the first to see the other fails; the other may see it ended by then
    assert proc.returncode == 1 and " overlapped " in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-2000:])
