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
