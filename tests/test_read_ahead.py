"""SQLite's due read-ahead (issue 11, ``Jobs.due_jobs``): one ordered read takes the next due candidates,
later polls recheck them by id. What others change between polls is seen at the next poll: a claimed, paused,
removed or moved job is not offered, an edited one is offered as it is now; only a job moved *earlier* than
the candidates waits, at most ``READ_AHEAD_FOR``."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from conftest import add_job

from mjsched_isolated.store import Store
from mjsched_isolated.store.jobs import READ_AHEAD_FOR

UTC = dt.UTC
NOW = dt.datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture
def two_stores(db_url: str):
    """The supervisor's store and another writer (the CLI, another supervisor) on the same SQLite file."""
    mine, other = Store.open(db_url), Store.open(db_url)
    yield mine, other
    mine.close()
    other.close()


def _ordered_reads(store: Store) -> list[str]:
    """The SQL of the due reads that order the backlog, as they run (the rechecks are by id, unordered)."""
    seen: list[str] = []

    @sa.event.listens_for(store.engine, "before_cursor_execute")
    def log(conn, cursor, statement, *args) -> None:
        if statement.lstrip().startswith("SELECT") and "ORDER BY jobs.next_run_at" in statement:
            seen.append(statement)

    return seen


def _names(rows) -> list[str]:
    return [r["name"] for r in rows]


def test_candidates_are_rechecked_by_id_and_what_others_changed_is_seen(two_stores):
    mine, other = two_stores
    for i in range(6):
        add_job(other, f"j{i}", "ok", now=NOW, next_run_at=NOW - dt.timedelta(minutes=10 - i))
    ordered = _ordered_reads(mine)
    assert _names(mine.due_jobs(NOW, 2)) == ["j0", "j1"]
    assert len(ordered) == 1
    # meanwhile: j0 claimed (moved on), j2 paused, j3 reconfigured, j1 untouched (still due: offered again)
    other.set_next_run_at(other.get_job("j0")["id"], NOW - dt.timedelta(minutes=10), NOW + dt.timedelta(hours=1),
                          NOW)
    other.update_job("j2", {"status": "Paused"}, NOW)
    other.update_job("j3", {"configuration": {"edited": True}}, NOW)
    later = NOW + dt.timedelta(milliseconds=100)
    rows = mine.due_jobs(later, 2)
    assert _names(rows) == ["j1", "j3"]
    assert '"edited": true' in rows[1]["configuration"]
    assert len(ordered) == 1  # no second ordering of the backlog: read from the candidates
    # a job removed is dropped from the candidates too
    other.remove_job("j1")
    assert _names(mine.due_jobs(later, 2)) == ["j3", "j4"]
    assert len(ordered) == 1


def test_candidates_are_read_afresh_after_a_second_when_short_or_when_now_goes_back(two_stores):
    mine, other = two_stores
    for i in range(3):
        add_job(other, f"j{i}", "ok", now=NOW, next_run_at=NOW - dt.timedelta(minutes=5 - i))
    ordered = _ordered_reads(mine)
    assert _names(mine.due_jobs(NOW, 1)) == ["j0"]
    # an edit moves a job earlier than every candidate: seen at the latest READ_AHEAD_FOR later
    add_job(other, "early", "ok", now=NOW, next_run_at=NOW - dt.timedelta(hours=1))
    assert _names(mine.due_jobs(NOW + dt.timedelta(milliseconds=10), 1)) == ["j0"]
    assert _names(mine.due_jobs(NOW + READ_AHEAD_FOR, 1)) == ["early"]
    assert len(ordered) == 2
    # more wanted than there are candidates (4 due were read): a fresh read, so a job due since is not held back
    add_job(other, "new", "ok", now=NOW, next_run_at=NOW + READ_AHEAD_FOR)
    assert _names(mine.due_jobs(NOW + READ_AHEAD_FOR, 10)) == ["early", "j0", "j1", "j2", "new"]
    assert len(ordered) == 3
    # the caller's clock went back: read afresh (a candidate may not be due at that instant)
    assert _names(mine.due_jobs(NOW - dt.timedelta(minutes=4, seconds=30), 10)) == ["early", "j0"]
    assert len(ordered) == 4


def test_a_claim_here_drops_its_job_from_the_candidates(two_stores):
    mine, other = two_stores
    for i in range(4):
        add_job(other, f"j{i}", "ok", now=NOW, next_run_at=NOW - dt.timedelta(minutes=5 - i))
    first = mine.due_jobs(NOW, 2)
    for job in first:
        claim = mine.claim(job, now=NOW, next_run_at=NOW + dt.timedelta(hours=1), instance="me", lease_s=60,
                           deadline_at=NOW + dt.timedelta(minutes=1), scheduled_at=job["next_run_at"])
        assert claim is not None
    assert _names(mine.due_jobs(NOW, 2)) == ["j2", "j3"]
    assert mine.due_jobs(NOW, 2) == mine.due_jobs(NOW, 2)  # not claimed: offered again, the same rows
