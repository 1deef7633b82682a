"""A worker's pins (client.vllm.pins.PinQueue): each goes out once the saves handed over
before it are published, on a thread of its own, through every client the worker saved
with; a pin that fails is counted and logged, never raised. No engine, no store: the
saves are futures the test completes, the clients record what they were asked."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import pytest

pytest.importorskip("vllm")  # client.vllm's stats import vLLM's types

from client.vllm.pins import PinQueue, PinSpec
from client.vllm.stats import StatsRecorder
from kvstore.control.reports import ControlReport
from kvstore.pages.identity import NO_EXTRAS, BlockExtras

SALTED = BlockExtras(((0, b"s" * 16),))


class RecordingClient:
    """What a worker's client is asked to pin, with the thread and the moment; it
    answers as a node holding every page would (``report``: another answer; ``fails``:
    every pin raises it)."""

    def __init__(self, fails: Exception | None = None, report: ControlReport | None = None) -> None:
        self.fails = fails
        self.report = report
        self.pins: list[tuple[list[int], BlockExtras | None, float | None, str, float]] = []

    def pin(self, token_ids, *, identity=None, ttl_s=None) -> ControlReport:
        self.pins.append(
            (list(token_ids), identity, ttl_s, threading.current_thread().name, time.monotonic())
        )
        if self.fails is not None:
            raise self.fails
        return self.report or ControlReport("pin", pages=len(token_ids) // 32, memory=1)


def _settle(queue: PinQueue, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while queue.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not queue.in_flight


def test_a_pin_waits_for_the_saves_handed_over_before_it_and_not_for_later_ones():
    stats = StatsRecorder()
    queue = PinQueue(stats)
    target, draft = RecordingClient(), RecordingClient()
    earlier, this_step, later = Future(), Future(), Future()
    try:
        queue.after(
            [PinSpec("sys", list(range(64)), SALTED, 600.0)], {earlier, this_step}, [target, draft]
        )
        time.sleep(0.1)
        earlier.set_result(None)
        time.sleep(0.1)
        assert target.pins == []  # this step's save is still being published
        published = time.monotonic()
        this_step.set_result(None)
        _settle(queue)
        # a later save (handed over after the pin) never held it up
        assert not later.done()
    finally:
        queue.shutdown()
    for client in (target, draft):
        ((tokens, identity, ttl, thread, when),) = client.pins
        assert tokens == list(range(64)) and identity == SALTED and ttl == 600.0
        assert thread.startswith("kvstore-pin") and when >= published
    assert stats.take_stats().data["pins"] == 1


def test_the_engine_thread_never_waits_for_a_pin():
    """``after`` hands the pin over and returns while the save it waits for is still
    pending (it never resolves before the check): an engine thread that waited would
    never come back. A thread of its own, joined with a bound, so a wait fails the
    test rather than hanging it (no timing bound: a loaded machine is slow, not wrong)."""
    queue = PinQueue(StatsRecorder())
    pending: Future = Future()
    try:
        caller = threading.Thread(
            target=queue.after, args=([PinSpec("r", [1] * 32)], [pending], [RecordingClient()])
        )
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), "after() waited for the pending save"
        assert not pending.done() and len(queue.in_flight) == 1
    finally:
        pending.set_result(None)
        queue.shutdown()
    assert not queue.in_flight


def test_a_failed_pin_is_counted_and_logged_never_raised(caplog):
    caplog.set_level(logging.DEBUG, logger="client.vllm.pins")  # repeats: DEBUG
    stats = StatsRecorder()
    queue = PinQueue(stats)
    broken = RecordingClient(fails=ConnectionError("no live node answered"))
    done: Future = Future()
    done.set_result(None)
    try:
        queue.after([PinSpec("req-3", [5] * 96, NO_EXTRAS, None)], [done], [broken])
        _settle(queue)
    finally:
        queue.shutdown()
    data = stats.take_stats().data
    assert data["pin_failures"] == 1 and data["pins"] == 0
    assert "req-3" in caplog.text and "no live node answered" in caplog.text
    assert "request is unaffected" in caplog.text


@pytest.mark.parametrize(
    ("report", "said"),
    [
        (ControlReport("pin"), "no node held its pages"),
        (
            ControlReport("pin", pages=3, unreachable={"node-1": "connection refused"}),
            "node node-1 unreachable (connection refused)",
        ),
    ],
)
def test_a_pin_that_pinned_nothing_or_missed_a_node_is_a_failure(report, said, caplog):
    caplog.set_level(logging.DEBUG, logger="client.vllm.pins")  # repeats: DEBUG
    stats = StatsRecorder()
    queue = PinQueue(stats)
    queue.after([PinSpec("req-4", [5] * 64)], [], [RecordingClient(report=report)])
    _settle(queue)
    queue.shutdown()
    assert stats.take_stats().data["pin_failures"] == 1
    assert "req-4" in caplog.text and said in caplog.text


def test_shutdown_waits_briefly_then_drops_the_pins_left(caplog, monkeypatch):
    """A worker's exit is not held up for long by pins whose saves never finish."""
    monkeypatch.setattr("client.vllm.pins.SHUTDOWN_WAIT_S", 0.2)
    caplog.set_level(logging.WARNING, logger="client.vllm.pins")
    queue = PinQueue(StatsRecorder())
    client = RecordingClient()
    stuck: Future = Future()
    queue.after([PinSpec("a", [1] * 32), PinSpec("b", [2] * 32)], [stuck], [client])
    started = time.monotonic()
    queue.shutdown()
    assert time.monotonic() - started < 1
    assert "2 pin(s) not sent before shutdown" in caplog.text
    stuck.set_result(None)  # the running one goes on; the queued one was dropped
    time.sleep(0.2)
    assert [tokens for tokens, *_ in client.pins] == [[1] * 32]


def test_no_pins_or_no_clients_send_nothing():
    queue = PinQueue(StatsRecorder())
    client = RecordingClient()
    queue.after([], [], [client])
    queue.after([PinSpec("r", [1] * 32)], [], [])  # a rank that saved nothing pins nothing
    queue.shutdown()
    assert client.pins == [] and not queue.in_flight
