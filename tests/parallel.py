"""The suite in parallel (pytest-xdist, pyproject's addopts ``--numprocesses=logical --dist=loadgroup``): the
``serial`` group and the ``alone`` marker. A pytest plugin: conftest.py imports its hooks, and
tests/test_parallel.py loads it (``-p parallel``) into a pytest of its own.

``serial`` (``pytest.mark.xdist_group("serial")``): the tests whose point is real time under real processes
(lease TTLs of a few seconds, fencing deadlines) or that load the machine (three supervisors with four
workers each, a mypy run, the dashboard's browser). They form one xdist group: one worker runs them one
after another (loadgroup hands the largest group out first), beside the short tests of the other workers,
never beside each other.

``alone`` (a marker): the test runs while no other test of the session runs (it stops the shared PostgreSQL
server). Every test holds a shared lock on a file of the session for its setup, call and teardown, and an
``alone`` test holds it exclusively. flock does not queue writers, so a second lock, the gate, keeps new
tests from starting while an ``alone`` test waits for those in flight: a test passes the gate (shared,
released at once) before taking its lock, and an ``alone`` test holds the gate exclusively until it ends.
An ``alone`` test is in the ``serial`` group too. Without xdist (``-n 0``) nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_until

serial = pytest.mark.xdist_group("serial")

# An alone test waits for the tests in flight (the longest allows 180 s), a test for an alone one: bounded
TURN_WAIT_S = 300.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: runs while no other test of the session runs (tests/parallel.py)")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("alone") is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(serial)


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside pytest-timeout's timer: waiting for a turn is no test time
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return (yield)
    with _turn(item):
        return (yield)


@contextlib.contextmanager
def _turn(item: pytest.Item) -> Iterator[None]:
    """Holds this test's turn: shared beside the other tests, exclusive for an ``alone`` one."""
    folder = Path(item.config.option.basetemp).parent  # xdist's worker gwN has <the session's basetemp>/popen-gwN
    alone = item.get_closest_marker("alone") is not None
    gate = _lock(folder / "mjsched-gate.lock", shared=not alone)
    try:
        if not alone:
            os.close(gate)  # passed
        turn = _lock(folder / "mjsched-turn.lock", shared=not alone)
        try:
            yield
        finally:
            os.close(turn)
    finally:
        if alone:
            os.close(gate)


def _lock(path: Path, *, shared: bool) -> int:
    """An open descriptor of ``path`` holding its flock, shared or exclusive, waited for at most
    :data:`TURN_WAIT_S` (failing with the lock's name otherwise)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def taken() -> bool:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    try:
        wait_until(taken, TURN_WAIT_S, f"{'shared' if shared else 'exclusive'} {path.name}", interval_s=0.05)
    except BaseException:
        os.close(fd)
        raise
    return fd
