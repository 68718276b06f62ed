"""``logs.BatchingStreamHandler``: the supervisor's loop writes the lines of a step (a line per run started
and one per run ended, issue 11) with one write, in the order they were logged, and at the latest before
it waits."""

from __future__ import annotations

import io
import logging
import threading

import pytest

from mjsched_isolated import logs


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


@pytest.fixture
def stream():
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    logs.configure("INFO", "text")
    out = CountingStream()
    root.handlers[0].setStream(out)  # type: ignore[attr-defined]
    yield out
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved_handlers:
        root.addHandler(handler)
    root.setLevel(saved_level)


def test_lines_of_a_batch_are_written_with_one_write_at_its_end(stream):
    log = logging.getLogger("mjsched.supervisor")
    with logs.batched():
        for n in range(5):
            log.info("run %d started", n)
        assert stream.writes == []  # kept until the batch ends
    assert len(stream.writes) == 1
    lines = stream.getvalue().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == [f"run {n} started" for n in range(5)]
    log.info("outside")  # without a batch: written at once
    assert len(stream.writes) == 2 and stream.writes[-1].endswith("outside\n")


def test_another_thread_s_line_comes_after_the_kept_ones(stream):
    log = logging.getLogger("mjsched.supervisor")
    with logs.batched():
        log.info("first")
        other = threading.Thread(target=lambda: log.warning("from another thread"))
        other.start()
        other.join(10)
        log.info("third")
    lines = [line.split(": ", 1)[1] for line in stream.getvalue().splitlines()]
    assert lines == ["first", "from another thread", "third"]


def test_nested_batches_join_the_outer_one_and_flush_writes_kept_lines(stream):
    log = logging.getLogger("mjsched.supervisor")
    with logs.batched():
        log.info("a")
        with logs.batched():
            log.info("b")
        assert stream.writes == []
        logging.getLogger().handlers[0].flush()  # logging.shutdown at exit: nothing kept is lost
        assert stream.getvalue().count("\n") == 2
    assert stream.getvalue().count("\n") == 2


def test_lean_records_carry_what_standard_records_carry():
    """``configure`` installs :class:`logs.LeanLogRecord` (issue 11): the same fields and values as the
    standard constructor's record made without the caller lookup (but the times); a record that names its
    caller's file is the standard one's."""
    saved = logging.getLogRecordFactory()
    logs.configure("INFO", "text")
    try:
        assert logging.getLogRecordFactory() is logs.LeanLogRecord
        for args in ((1, "x"), ({"k": 1},), ()):
            lean = logs.LeanLogRecord("a.b", logging.WARNING, "(unknown file)", 0, "m %s", args, None,
                                      "(unknown function)", None)
            std = logging.LogRecord("a.b", logging.WARNING, "(unknown file)", 0, "m %s", args, None,
                                    "(unknown function)", None)
            times = ("created", "msecs", "relativeCreated")
            assert {k: v for k, v in vars(lean).items() if k not in times} == {
                k: v for k, v in vars(std).items() if k not in times}
            assert 0 <= std.created - lean.created < 1 and 0 <= lean.msecs < 1000
        named = logs.LeanLogRecord("a", logging.INFO, "/x/y/mod.py", 3, "m", (), None, "f", None)
        assert (named.filename, named.module, named.lineno) == ("mod.py", "mod", 3)
    finally:
        logging.setLogRecordFactory(saved)


def test_iso_texts_of_equal_instants_are_one_text():
    """``isotime.iso`` keeps the texts of recent instants (issue 11: log lines name the same ones again and
    again): an equal instant in another zone, or a naive one (taken as UTC), reads the same; a full cache
    is emptied, never wrong."""
    import datetime as dt

    from mjsched_isolated import isotime
    base = dt.datetime(2026, 12, 1, 21, 0, tzinfo=dt.UTC)
    for i in range(isotime.CACHE_SIZE * 2 + 3):
        when = base + dt.timedelta(seconds=i, microseconds=i * 7)
        text = when.isoformat().replace("+00:00", "Z")
        assert isotime.iso(when) == text
        assert isotime.iso(when.astimezone(dt.timezone(dt.timedelta(hours=5, minutes=30)))) == text
        assert isotime.iso(when.replace(tzinfo=None)) == text
        assert isotime.iso(when, timespec="seconds") == when.isoformat(timespec="seconds").replace("+00:00", "Z")
        assert len(isotime._AUTO) <= isotime.CACHE_SIZE
    assert isotime.iso(None) == "-" and isotime.iso(None, missing=None) is None
