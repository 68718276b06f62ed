"""protocol: every message round-trips through send/decode over a real multiprocessing Pipe."""

from __future__ import annotations

import multiprocessing
import os
import threading

import msgspec
import pytest

from mjsched_isolated import protocol
from mjsched_isolated.errors import MjschedError, ProtocolError
from mjsched_isolated.protocol import (
    Heartbeat,
    LoadFailure,
    PluginInfo,
    Ready,
    RunFinished,
    RunRequest,
    RunStarted,
    Stop,
    ValidateReply,
    ValidateRequest,
)

TO_CHILD = [
    RunRequest(run_id=1, job_id=2, job_name="backup", job_type="ok", configuration='{"seconds": 1.5}',
               scheduled_at=1_700_000_000.25, deadline_at=1_700_000_300.5),
    RunRequest(run_id=3, job_id=4, job_name="manual", job_type="ok", configuration=None),
    ValidateRequest(job_type="picky", configuration='{"seconds": -1}'),
    ValidateRequest(job_type="ok", configuration=None),
    Stop(),
]

TO_SUPERVISOR = [
    Ready(pid=1234, plugins=[], failures=[]),
    Ready(pid=99, plugins=[PluginInfo(job_type="ok", module="behaviours.py", description="succeeds"),
                           PluginInfo(job_type="fail", module="behaviours.py")],
          failures=[LoadFailure(module="broken_import.py", error="Traceback ...\nImportError: nope\n")]),
    Ready(pid=5, plugins=[PluginInfo(job_type="shell", module="mjsched_isolated.plugins.shell", builtin=True)],
          failures=[], warnings=["plugin my_shell.py overrides the built-in job type 'shell'"]),
    RunStarted(run_id=7, at=1_700_000_000.125),
    Heartbeat(run_id=7, at=1_700_000_001.0),
    RunFinished(run_id=7, success=True),
    RunFinished(run_id=8, success=False, error_message="RuntimeError: kaboom",
                details={"nested": {"list": [1, 2.5, "x", None, True]}, "n": 3}),
    ValidateReply(),
    ValidateReply(error="configuration.seconds: must be >= 0"),
]


@pytest.fixture(params=["channel", "socket pair"])
def pipe(request):
    channel = request.param == "channel"
    a, b = protocol.channel_pair(multiprocessing.get_context()) if channel else multiprocessing.Pipe()
    yield a, b
    a.close()
    b.close()


def _through(pipe, message) -> bytes:
    sender, receiver = pipe
    protocol.send(sender, message)
    assert receiver.poll(5), "message did not arrive"
    return receiver.recv_bytes()


@pytest.mark.parametrize("message", TO_CHILD, ids=lambda m: type(m).__name__)
def test_supervisor_to_child_round_trip(pipe, message):
    decoded = protocol.decode_to_child(_through(pipe, message))
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize("message", TO_SUPERVISOR, ids=lambda m: type(m).__name__)
def test_child_to_supervisor_round_trip(pipe, message):
    decoded = protocol.decode_to_supervisor(_through(pipe, message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_ready_with_plugins_and_failures_round_trips_field_by_field(pipe):
    ready = TO_SUPERVISOR[1]
    decoded = protocol.decode_to_supervisor(_through(pipe, ready))
    assert isinstance(decoded, Ready)
    assert decoded.pid == 99
    assert [p.job_type for p in decoded.plugins] == ["ok", "fail"]
    assert all(isinstance(p, PluginInfo) for p in decoded.plugins)
    assert decoded.plugins[0].description == "succeeds"
    assert decoded.plugins[1].description == ""
    assert decoded.failures == [LoadFailure(module="broken_import.py", error="Traceback ...\nImportError: nope\n")]
    assert isinstance(decoded.failures[0], LoadFailure)


def test_messages_keep_their_order_over_the_pipe(pipe):
    sender, receiver = pipe
    for m in TO_SUPERVISOR:
        protocol.send(sender, m)
    got = []
    for _ in TO_SUPERVISOR:
        assert receiver.poll(5)
        got.append(protocol.decode_to_supervisor(receiver.recv_bytes()))
    assert got == TO_SUPERVISOR


@pytest.mark.parametrize("garbage", [b"", b"\xff\xfe\x00garbage", b"not msgpack at all", b"\xc1",
                                     msgspec.msgpack.encode({"type": "NoSuchMessage"}),
                                     msgspec.msgpack.encode([1, 2, 3]),
                                     msgspec.msgpack.encode({"type": "RunStarted", "run_id": "x", "at": 1.0})])
def test_garbage_raises_protocol_error(garbage):
    with pytest.raises(ProtocolError):
        protocol.decode_to_supervisor(garbage)
    with pytest.raises(ProtocolError):
        protocol.decode_to_child(garbage)


def test_protocol_error_is_a_project_error():
    with pytest.raises(MjschedError):
        protocol.decode_to_child(b"\x00\x01")


def test_message_for_the_other_direction_is_rejected(pipe):
    with pytest.raises(ProtocolError):
        protocol.decode_to_child(_through(pipe, RunFinished(run_id=1, success=True)))
    with pytest.raises(ProtocolError):
        protocol.decode_to_supervisor(_through(pipe, Stop()))


def test_missing_required_field_is_rejected():
    data = msgspec.msgpack.encode({"type": "RunRequest", "run_id": 1, "job_id": 2})
    with pytest.raises(ProtocolError) as info:
        protocol.decode_to_child(data)
    assert "child" in str(info.value)


def test_decoder_accepts_unknown_extra_fields_for_forward_compatibility():
    data = msgspec.msgpack.encode({"type": "Heartbeat", "run_id": 5, "at": 2.0, "added_later": "x"})
    assert protocol.decode_to_supervisor(data) == Heartbeat(run_id=5, at=2.0)


def test_send_to_closed_peer_raises_oserror(pipe):
    a, b = pipe
    b.close()
    try:
        with pytest.raises(OSError):
            protocol.send(a, Stop())
    finally:
        a.close()


def test_a_channel_reads_eof_when_its_peer_is_gone_and_pickles_as_its_two_pipes():
    a, b = protocol.channel_pair(multiprocessing.get_context())
    assert a.__reduce__() == (protocol.Channel, (a.reader, a.writer))
    assert {a.fileno(), a.writer.fileno()}.isdisjoint({b.fileno(), b.writer.fileno()})
    b.close()
    assert b.closed
    with pytest.raises(EOFError):
        a.recv_bytes()
    a.close()


def test_a_ready_from_an_older_worker_decodes_with_defaults():
    """New fields have defaults: a Ready without ``warnings`` and a PluginInfo without ``builtin`` (as an
    older worker sends them) still decode."""
    old = msgspec.msgpack.encode({"type": "Ready", "pid": 9, "failures": [],
                                  "plugins": [{"job_type": "ok", "module": "behaviours.py", "description": ""}]})
    ready = protocol.decode_to_supervisor(old)
    assert isinstance(ready, Ready) and ready.warnings == []
    assert ready.plugins == [PluginInfo(job_type="ok", module="behaviours.py", builtin=False)]


def test_the_workers_direct_framing_reads_and_writes_what_a_connection_does():
    """The worker writes its messages straight to its pipe (``send_fd``) and reads its supervisor's with one
    ``read`` for as many as are there (``FrameReader``): the same frames as ``Connection.send_bytes`` /
    ``recv_bytes``, either way, several messages in one read and one message split over reads included."""
    supervisor, child = protocol.channel_pair(multiprocessing.get_context())
    try:
        for message in TO_SUPERVISOR:
            protocol.send_fd(protocol.write_fd(child), message)
        assert [protocol.decode_to_supervisor(supervisor.recv_bytes()) for _ in TO_SUPERVISOR] == TO_SUPERVISOR
        frames = protocol.FrameReader(child.fileno())
        assert frames.recv_ready() is None  # nothing there: never waits
        for message in TO_CHILD:
            protocol.send(supervisor, message)
        assert [protocol.decode_to_child(frames.recv_bytes()) for _ in TO_CHILD] == TO_CHILD
        big = RunRequest(run_id=5, job_id=6, job_name="big", job_type="ok", configuration="x" * 5_000_000)
        writer = threading.Thread(target=protocol.send, args=(supervisor, big))  # more than the pipe holds
        writer.start()
        assert protocol.decode_to_child(frames.recv_bytes()) == big
        writer.join(5)
        encoded = msgspec.msgpack.encode(Stop())
        # a message only partly there is kept and not waited for; the length's long form is understood
        os.write(supervisor.writer.fileno(), b"\xff\xff\xff\xff" + len(encoded).to_bytes(8, "big") + encoded[:1])
        assert frames.recv_ready() is None
        os.write(supervisor.writer.fileno(), encoded[1:])
        assert frames.recv_ready() == encoded
        for byte in len(encoded).to_bytes(4, "big") + encoded:  # one byte a read, the length included
            assert frames.recv_ready() is None
            os.write(supervisor.writer.fileno(), bytes([byte]))
        assert frames.recv_ready() == encoded
        supervisor.close()
        with pytest.raises(EOFError):
            frames.recv_bytes()
    finally:
        supervisor.close()
        child.close()
