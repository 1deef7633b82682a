"""Helpers of the test_kv_events* files: a subscriber that decodes with vLLM's own types
(``Reader``), a stored event, waits, and a publisher fixture closed after each test."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from kvstore import events as ev

vk = pytest.importorskip("vllm.distributed.kv_events")

TOPIC = ev.pool_topic("store-1", "llama-3-8b")


def vllm_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type=vk.KVEventBatch)


class Reader:
    """A SUB socket read on a thread of its own until ``close``; ``messages``: (topic,
    sequence, payload) as they came. Connects to ``endpoint``; without one it binds a
    free port (``self.endpoint``) for the publisher to connect to. ``read=False``: a
    subscriber that never reads."""

    def __init__(self, endpoint: str | None = None, *, hwm: int = 1000, read: bool = True) -> None:
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if endpoint is None:
            self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            self.sock.connect(endpoint)
            self.endpoint = endpoint
        self.messages: list[tuple[bytes, int, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True) if read else None
        if self._thread is not None:
            self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                topic, seq, payload = self.sock.recv_multipart()
                self.messages.append((topic, int.from_bytes(seq, "big"), payload))

    def events(self) -> list:
        decoder = vllm_decoder()
        return [e for _, _, payload in list(self.messages) for e in decoder.decode(payload).events]

    def stop_reading(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        self.stop_reading()
        self.sock.close(linger=0)
        self._ctx.term()


def wait_until(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def connected(pub: ev.EventPublisher, reader: Reader) -> None:
    """Publish probes until the reader sees one (a SUB joins a PUB asynchronously), then
    forget them."""
    deadline = time.monotonic() + 10
    while not reader.messages:
        assert time.monotonic() < deadline, "the subscriber never joined"
        pub.publish([ev.block_removed([0])])
        time.sleep(0.02)
    wait_until(lambda: pub.stats().queued_events == 0)
    time.sleep(0.05)
    reader.messages.clear()


def stored(i: int, *, parent: int | None = None, block_size: int = 16) -> ev.BlockStored:
    return ev.block_stored(
        [i], list(range(i, i + block_size)), block_size, parent_block_hash=parent
    )


# ---- the format ----------------------------------------------------------------------


@pytest.fixture()
def publisher():
    made: list[ev.EventPublisher] = []

    def make(**options) -> ev.EventPublisher:
        pub = ev.EventPublisher(
            ev.PublisherOptions(
                **{"endpoint": "tcp://127.0.0.1:0", "mode": "bind", "topic": TOPIC, **options}
            )
        )
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()
