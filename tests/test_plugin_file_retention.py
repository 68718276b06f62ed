"""Tests of mjsched_isolated/plugins/file_retention.py on real files aged with os.utime."""

from __future__ import annotations

import os
import sys
import time

import pytest
from plugin_helpers import load_plugin, make_context, run_job

from mjsched_isolated.errors import ConfigurationError

FileRetentionJob = load_plugin("file_retention")
DAY = 86400


def _file(path, days_old: float, size: int = 10):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    when = time.time() - days_old * DAY
    os.utime(path, (when, when))
    return path


@pytest.fixture
def tree(tmp_path):
    """root/ with old and new files at several depths, an old directory matching the pattern, and links
    pointing outside root (to an old file and to a directory of old files)."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    _file(root / "old.log", 10, size=100)
    _file(root / "new.log", 1)
    _file(root / "old.txt", 10)
    _file(root / "sub" / "old.log", 12, size=7)
    _file(root / "sub" / "deep" / "old.log", 20, size=3)
    (root / "olddir.log").mkdir()
    os.utime(root / "olddir.log", (time.time() - 30 * DAY,) * 2)
    _file(outside / "target.log", 30)
    _file(outside / "dir" / "old.log", 30)
    (root / "link.log").symlink_to(outside / "target.log")
    (root / "linkdir").symlink_to(outside / "dir", target_is_directory=True)
    return root


def _outside_intact(root):
    outside = root.parent / "outside"
    assert (outside / "target.log").is_file() and (outside / "dir" / "old.log").is_file()


def test_top_level_pattern_removes_only_old_matching_files(tree):
    result = run_job(FileRetentionJob, {"directory": str(tree), "pattern": "*.log", "older_than_days": 5})
    assert result.success, result.error_message
    d = result.details
    assert d["removed"] == ["old.log"] and d["removed_count"] == 1 and d["bytes_freed"] == 100
    assert d["matched"] == 2 and d["eligible"] == 1  # old.log, new.log (the link and the directory are not files)
    assert not (tree / "old.log").exists()
    for kept in ("new.log", "old.txt", "sub/old.log", "olddir.log", "link.log"):
        assert os.path.lexists(tree / kept), kept
    _outside_intact(tree)


def test_recursive_pattern_never_leaves_the_directory(tree):
    result = run_job(FileRetentionJob, {"directory": str(tree), "pattern": "**/*.log", "older_than_days": 5})
    assert result.success, result.error_message
    d = result.details
    assert d["removed"] == ["sub/deep/old.log", "sub/old.log", "old.log"]  # oldest first
    assert d["bytes_freed"] == 110
    assert (tree / "new.log").exists() and (tree / "olddir.log").is_dir() and (tree / "link.log").is_symlink()
    _outside_intact(tree)


def test_subdirectory_pattern(tree):
    result = run_job(FileRetentionJob, {"directory": str(tree), "pattern": "sub/*.log", "older_than_days": 5})
    assert result.success and result.details["removed"] == ["sub/old.log"]
    assert (tree / "sub" / "deep" / "old.log").exists()


def test_dry_run_reports_without_deleting(tree):
    result = run_job(
        FileRetentionJob, {"directory": str(tree), "pattern": "**/*.log", "older_than_days": 5, "dry_run": True}
    )
    assert result.success
    assert result.details["dry_run"] is True and result.details["removed_count"] == 3
    assert (tree / "old.log").exists() and (tree / "sub" / "deep" / "old.log").exists()
    note = FileRetentionJob().format_notification(make_context(FileRetentionJob, {
        "directory": str(tree), "pattern": "*", "older_than_days": 1}), result)
    assert "would remove 3 file(s)" in note.body


def test_max_deletes_removes_oldest_first(tree):
    result = run_job(
        FileRetentionJob, {"directory": str(tree), "pattern": "**/*.log", "older_than_days": 5, "max_deletes": 2}
    )
    assert result.success
    assert result.details["removed"] == ["sub/deep/old.log", "sub/old.log"]
    assert result.details["skipped_by_cap"] == 1
    assert (tree / "old.log").exists()


def test_character_classes_and_question_mark(tmp_path):
    for name in ("a1.log", "b1.log", "c1.log", "ab.log"):
        _file(tmp_path / name, 10)
    result = run_job(FileRetentionJob, {"directory": str(tmp_path), "pattern": "[!c]?.log", "older_than_days": 1})
    assert sorted(result.details["removed"]) == ["a1.log", "ab.log", "b1.log"]


def test_removed_list_is_truncated_but_counted(tmp_path):
    for i in range(105):
        _file(tmp_path / f"f{i:03}.tmp", 3, size=1)
    result = run_job(FileRetentionJob, {"directory": str(tmp_path), "pattern": "*.tmp", "older_than_days": 2})
    d = result.details
    assert result.success and d["removed_count"] == 105 and len(d["removed"]) == 100 and d["removed_truncated"]
    assert d["bytes_freed"] == 105 and not list(tmp_path.iterdir())


def test_undeletable_file_is_recorded_and_others_still_go(tmp_path, monkeypatch):
    _file(tmp_path / "a.log", 10)
    _file(tmp_path / "locked" / "b.log", 11)
    _file(tmp_path / "c.log", 9)
    if os.geteuid() == 0:  # root ignores directory permissions: make that one unlink fail instead
        module = sys.modules[FileRetentionJob.__module__]
        real_unlink = os.unlink

        def unlink(path, *args, **kwargs):
            if os.path.basename(os.path.dirname(path)) == "locked":
                raise PermissionError(1, "Operation not permitted", path)
            return real_unlink(path, *args, **kwargs)

        monkeypatch.setattr(module.os, "unlink", unlink)
    else:
        (tmp_path / "locked").chmod(0o500)
    try:
        result = run_job(FileRetentionJob, {"directory": str(tmp_path), "pattern": "**/*.log", "older_than_days": 1})
    finally:
        (tmp_path / "locked").chmod(0o700)
    assert not result.success
    assert result.details["error_count"] == 1 and result.details["errors"][0]["path"] == "locked/b.log"
    assert "PermissionError" in result.details["errors"][0]["error"]
    assert sorted(result.details["removed"]) == ["a.log", "c.log"]
    assert result.error_message.startswith("1 error(s), first: locked/b.log")
    assert (tmp_path / "locked" / "b.log").exists()


def test_missing_directory_is_a_failure(tmp_path):
    result = run_job(FileRetentionJob, {"directory": str(tmp_path / "nope"), "pattern": "*", "older_than_days": 1})
    assert not result.success and result.error_message.startswith("not a directory")


@pytest.mark.parametrize(
    ("changes", "prefix"),
    [
        ({"pattern": "/etc/*"}, "configuration.pattern"),
        ({"pattern": "../*.log"}, "configuration.pattern"),
        ({"pattern": "a//b"}, "configuration.pattern"),
        ({"pattern": "a**b/*.log"}, "configuration.pattern"),
        ({"pattern": "logs/**"}, "configuration.pattern"),
        ({"pattern": ""}, "configuration.pattern"),
        ({"older_than_days": 0}, "configuration.older_than_days"),
        ({"older_than_days": -1.5}, "configuration.older_than_days"),
        ({"max_deletes": 0}, "configuration.max_deletes"),
        ({"dry_run": "yes"}, "configuration.dry_run"),
        ({"directory": ""}, "configuration.directory"),
    ],
)
def test_bad_configuration_names_the_field(tmp_path, changes, prefix):
    config = {"directory": str(tmp_path), "pattern": "*.log", "older_than_days": 7, **changes}
    with pytest.raises(ConfigurationError) as info:
        make_context(FileRetentionJob, config)
    assert str(info.value).startswith(prefix), str(info.value)
