"""Tests of mjsched_isolated/plugins/sqlite_backup.py with real SQLite databases."""

from __future__ import annotations

import re
import sqlite3
import sys

import pytest
from plugin_helpers import load_plugin, make_context, run_job

from mjsched_isolated.errors import ConfigurationError

SqliteBackupJob = load_plugin("sqlite_backup")
NAME = re.compile(r"^app-\d{8}T\d{12}Z\.db$")


@pytest.fixture
def database(tmp_path):
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, payload TEXT)")
        conn.executemany("INSERT INTO items (payload) VALUES (?)", [(f"row-{i}-" + "p" * 200,) for i in range(2000)])
    conn.close()
    return path


def _rows(path):
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT count(*), max(payload) FROM items").fetchone()
    finally:
        conn.close()


def test_backup_copies_data_under_a_timestamped_name(database, tmp_path):
    dest = tmp_path / "backups" / "nested"
    result = run_job(SqliteBackupJob, {"database": str(database), "destination_dir": str(dest)})
    assert result.success, result.error_message
    d = result.details
    backup = dest / NAME.match(d["backup_path"].rsplit("/", 1)[-1]).group(0)
    assert str(backup) == d["backup_path"]
    assert d["size_bytes"] == backup.stat().st_size > 0
    assert d["pages"] > 100 and d["removed"] == [] and d["kept"] == 1
    assert _rows(backup) == _rows(database) and _rows(backup)[0] == 2000
    assert [p.name for p in dest.iterdir()] == [backup.name]  # no partial file left, no -wal/-shm
    conn = sqlite3.connect(backup)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # self-contained copy
    finally:
        conn.close()


def test_backup_is_online_and_sees_only_committed_data(database, tmp_path):
    writer = sqlite3.connect(database, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("INSERT INTO items (payload) VALUES ('uncommitted')")
        result = run_job(SqliteBackupJob, {"database": str(database), "destination_dir": str(tmp_path / "b")})
        writer.execute("ROLLBACK")
    finally:
        writer.close()
    assert result.success, result.error_message
    assert _rows(result.details["backup_path"])[0] == 2000


def test_heartbeat_between_steps(database, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[SqliteBackupJob.__module__], "_HEARTBEAT_EVERY_S", 0.0)
    beats = []
    result = run_job(
        SqliteBackupJob,
        {"database": str(database), "destination_dir": str(tmp_path / "b"), "pages_per_step": 10},
        heartbeat=lambda: beats.append(1),
    )
    assert result.success, result.error_message
    assert len(beats) >= result.details["pages"] // 10 - 1


def test_keep_last_prunes_only_this_databases_backups(database, tmp_path):
    dest = tmp_path / "b"
    dest.mkdir()
    old = [f"app-2020010{i}T000000000000Z.db" for i in range(1, 5)]
    unrelated = ["app-notes.txt", "other-20200101T000000000000Z.db", "app-20200101T000000000000Z.db.bak",
                 "app-2020T0Z.db", "myapp-20200101T000000000000Z.db"]
    for name in old + unrelated:
        (dest / name).write_text("old")
    result = run_job(SqliteBackupJob, {"database": str(database), "destination_dir": str(dest), "keep_last": 2})
    assert result.success, result.error_message
    new = result.details["backup_path"].rsplit("/", 1)[-1]
    assert sorted(result.details["removed"]) == old[:3]
    assert result.details["kept"] == 2
    assert sorted(p.name for p in dest.iterdir()) == sorted([new, old[3], *unrelated])


def test_missing_database_is_an_error_and_not_created(tmp_path):
    missing = tmp_path / "missing.db"
    result = run_job(SqliteBackupJob, {"database": str(missing), "destination_dir": str(tmp_path / "b")})
    assert not result.success
    assert result.error_message == f"database not found: {missing}"
    assert not missing.exists()


def test_not_a_database_fails_without_leaving_files(tmp_path):
    bogus = tmp_path / "app.db"
    bogus.write_bytes(b"this is not sqlite" * 100)
    dest = tmp_path / "b"
    result = run_job(SqliteBackupJob, {"database": str(bogus), "destination_dir": str(dest)})
    assert not result.success
    assert result.error_message.startswith("backup failed: DatabaseError")
    assert list(dest.iterdir()) == []


def test_notification_mentions_the_backup(database, tmp_path):
    job = SqliteBackupJob()
    context = make_context(SqliteBackupJob, {"database": str(database), "destination_dir": str(tmp_path / "b")})
    result = job.execute(context)
    note = job.format_notification(context, result)
    assert note.priority == "Normal" and result.details["backup_path"] in note.body


@pytest.mark.parametrize(
    ("changes", "prefix"),
    [
        ({"keep_last": 0}, "configuration.keep_last"),
        ({"keep_last": "5"}, "configuration.keep_last"),
        ({"database": ":memory:"}, "configuration.database"),
        ({"database": "file:x.db?mode=rw"}, "configuration.database"),
        ({"destination_dir": ""}, "configuration.destination_dir"),
        ({"pages_per_step": 0}, "configuration.pages_per_step"),
    ],
)
def test_bad_configuration_names_the_field(changes, prefix):
    config = {"database": "app.db", "destination_dir": "backups", **changes}
    with pytest.raises(ConfigurationError) as info:
        make_context(SqliteBackupJob, config)
    assert str(info.value).startswith(prefix), str(info.value)
