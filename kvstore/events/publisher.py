"""A bounded publisher of vLLM-format KV events over ZMQ, for storage nodes.

What a subscriber sees is what vLLM's ``ZmqEventPublisher`` sends, so a router that
reads an engine's events reads a node's the same way:

- a PUB socket sending three frames per batch: ``[topic, sequence (u64 big-endian),
  msgpack KVEventBatch]``; sequence numbers start at 0 and grow by one per batch;
- optionally a ROUTER socket for replay: a client (REQ or DEALER) sends the first
  sequence it wants (8 bytes big-endian); it gets back every batch still held from
  that one on, ``[b"", topic, seq, payload]`` each, then ``[b"", b"", -1 (i64
  big-endian), b""]``.

Unlike vLLM's publisher, nothing here can block or grow without bound:

- ``publish`` never waits. Past ``max_queue_events`` queued events the call's events
  are dropped (counted in ``stats().dropped_events``), and the batch they would have
  gone into consumes a sequence number, so a subscriber sees the gap (vLLM's
  sequence numbers show a gap the same way when its PUB socket drops a batch).
- The replay window holds at most ``replay_batches`` batches and ``replay_bytes``.
- The PUB socket drops what a slow subscriber cannot take (its high-water mark).

With an ``EventAccess`` (kvstore.events.access) the stream is authenticated: both
sockets are CURVE servers whose handshakes a ZAP handler checks against the routers'
keys, the PUB socket is an XPUB that decides each subscription itself (a router gets
only its tenants' topics), and a replay sends a router only the batches it may read.
Refused handshakes and subscriptions are counted (``stats().refused_*``). When a reload
of the routers file takes a right away, both sockets are closed and bound again on the
same addresses: routers reconnect on their own and handshake with the new keys (a
sequence gap, which the replay fills).

One thread owns the sockets. It sleeps in ``zmq.Poller.poll`` with no timeout until a
publish wakes it (one byte on a pipe, written only when the queue was empty) or a
replay request arrives, so an idle publisher uses no CPU. When it wakes it takes
everything queued and sends it in batches of at most ``max_batch_events`` events:
under load one message carries many events, which is what lets one thread publish
well over 100,000 block events per second (bench/events.py)."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from kvstore.events.access import EventAccess
from kvstore.events.format import EventBatch, KVCacheEvent
from kvstore.events.gate import Gate
from kvstore.events.options import PublisherOptions, PublisherStats
from kvstore.events.replay import ReplayWindow
from kvstore.settings.events import binds

log = logging.getLogger(__name__)


class _Gap:
    """Where dropped events would have been in the queue: a sequence number is skipped there."""


_GAP = _Gap()


def _binds(endpoint: str, mode: str) -> bool:
    return binds(endpoint) if mode == "auto" else mode == "bind"


class EventPublisher:
    """Publishes ``KVCacheEvent`` lists as vLLM-format batches; see the module doc.

    Created by a storage node at start (binding or connecting raises ``zmq.ZMQError``
    there, not later); ``publish`` is called from any thread, ``close`` once at stop.
    Guarantees: events of one ``publish`` call are sent together, in call order, or
    all dropped; sequence numbers increase by one per batch and skip one wherever
    events were dropped."""

    def __init__(self, options: PublisherOptions, access: EventAccess | None = None) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._queue: deque[tuple[bytes, list[KVCacheEvent]] | _Gap] = deque()
        self._held = (
            0  # events queued or taken by the thread and not yet sent: what the bound counts
        )
        self._signaled = (
            False  # a wake-up byte is in the pipe and the thread has not taken the queue since
        )
        self._closing = False
        self._dropping = False  # the last publish call was dropped: a gap is already queued
        self._published_events = self._published_batches = self._dropped = self._skipped = 0
        self._rebinds = 0
        self._seq = 0
        self._replay = ReplayWindow(options.replay_batches, options.replay_bytes)
        self._topic = options.topic.encode()
        self._ctx = zmq.Context(io_threads=1)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._gate: Gate | None = None
        self._router: zmq.Socket | None = None
        try:
            if access is not None:
                if not _binds(options.endpoint, options.mode):
                    raise ValueError(
                        f"an authenticated event stream binds its sockets (routers connect and "
                        f"handshake): {options.endpoint} would connect"
                    )
                self._gate = Gate(self._ctx, access)
            self._binds = _binds(options.endpoint, options.mode)  # before a port 0 resolves
            self.endpoint = options.endpoint
            self.replay_endpoint: str | None = options.replay_endpoint
            self._open_sockets()
        except Exception:
            self._close_sockets()
            if self._gate is not None:
                self._gate.stop()
            self._ctx.destroy(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    def _open_sockets(self) -> None:
        """Make and attach the PUB (an XPUB deciding subscriptions when authenticated)
        and replay sockets; ``endpoint`` and ``replay_endpoint`` become the addresses
        bound (a port of 0 resolved), so a rebind takes the same ones."""
        opts = self.options
        self._pub = self._ctx.socket(zmq.PUB if self._gate is None else zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, opts.hwm)
        if self._gate is not None:
            self._gate.secure(self._pub)
            self._pub.setsockopt(zmq.XPUB_MANUAL, 1)  # the gate decides each subscription
        self.endpoint = self._attach(self._pub, self.endpoint, self._binds)
        if self.replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, opts.hwm)
            if self._gate is not None:
                self._gate.secure(self._router)
            self.replay_endpoint = self._attach(self._router, self.replay_endpoint, True)

    def _close_sockets(self, linger: int = 0) -> None:
        if self._gate is not None:
            self._gate.forget_sockets()
        if getattr(self, "_pub", None) is not None:
            self._pub.close(linger=linger)
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None

    @staticmethod
    def _attach(sock: zmq.Socket, endpoint: str, bind: bool) -> str:
        """Bind or connect; the address actually bound (a port of 0 resolved)."""
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # ---- any thread --------------------------------------------------------------

    def publish(self, events: Sequence[KVCacheEvent], topic: str | None = None) -> bool:
        """Queue ``events`` to be sent in order; never waits. False when they were
        dropped (the queue is full, or the publisher is closing); counted either way.
        ``topic``: this call's first frame instead of the options' (a storage node
        publishes each model's blocks under that model's topic; one socket and one
        sequence serve them all, as one vLLM engine's do)."""
        if not events:
            return True
        n = len(events)
        frame = self._topic if topic is None else topic.encode()
        with self._lock:
            if self._closing:
                self._dropped += n
                return False
            accepted = self._held + n <= self.options.max_queue_events
            if accepted:
                self._queue.append((frame, list(events)))
                self._held += n
                self._dropping = False
            else:
                self._dropped += n
                # One skipped number per run of dropped calls. The run is the calls', not
                # the queue's: the thread may take the queue between two drops, so "the
                # queue ends in a gap" would skip a second number depending on timing.
                if not self._dropping:
                    self._queue.append(_GAP)
                    self._dropping = True
            if not self._signaled:
                # under the lock: close() cannot have closed the pipe (it sets _closing first)
                self._signaled = True
                self._wake()
        return accepted

    def stats(self) -> PublisherStats:
        refused = self._gate.refused() if self._gate is not None else {}
        with self._lock:
            return PublisherStats(
                self._published_events,
                self._published_batches,
                self._dropped,
                self._seq,
                self._skipped,
                self._replay.requests,
                self._held,
                refused.get("handshake", 0),
                refused.get("key", 0),
                refused.get("subscription", 0),
                self._rebinds,
            )

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (at most ``timeout`` seconds), stop the thread, close
        the sockets. Later ``publish`` calls drop. Called once, by the owner."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("event publisher thread did not stop within %.1f s", timeout)
            return
        self._close_sockets(linger=self.options.close_linger_ms)
        if self._gate is not None:
            self._gate.stop()
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread will run

    # ---- the publisher thread ----------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = self._poller()
        # authenticated: wake once a second to see whether the routers file took a
        # right away (one stat() a second; an open stream sleeps until there is work)
        gate = self._gate
        timeout = None if gate is None else 1000
        generation = gate.access.generation() if gate is not None else 0
        rebind_due = False  # a rebind failed: tried again each second
        while True:
            ready = dict(poller.poll(timeout))
            if gate is not None:
                gate.serve(ready, self._pub)
                current = gate.access.generation()
                if current != generation or rebind_due:
                    generation = current
                    rebind_due = not self._rebind()
                    poller = self._poller()
            if self._router is not None and ready.get(self._router):
                self._replay.serve(self._router, self._gate.access if self._gate else None)
            if ready.get(self._wake_r):
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            with self._lock:
                items, self._queue = self._queue, deque()
                self._signaled = False
                closing = self._closing
            if items:
                self._send(items, encoder)
            if closing:
                with self._lock:
                    left = self._queue
                    self._queue = deque()
                if left:
                    self._send(left, encoder)
                return

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        if self._gate is not None:
            self._gate.register(poller, self._pub)
        return poller

    def _rebind(self) -> bool:
        """Close both sockets and bind them again on the same addresses, so every
        router handshakes with the routers file as it is now. False when an address
        stayed busy (the caller tries again a second later; meanwhile nothing is sent)."""
        self._close_sockets()
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self._open_sockets()
                break
            except zmq.ZMQError as exc:
                # ZMQ closes a listener on its I/O thread, a moment after close()
                self._close_sockets()
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    log.error("KV events: could not bind the event sockets again: %s", exc)
                    return False
                time.sleep(0.02)
        with self._lock:
            self._rebinds += 1
        log.warning(
            "KV events: the routers file took a right away; sockets bound again so every router authenticates anew"
        )
        return True

    def _send(
        self,
        items: deque[tuple[bytes, list[KVCacheEvent]] | _Gap],
        encoder: msgspec.msgpack.Encoder,
    ) -> None:
        """Send ``items`` as batches of at most ``max_batch_events`` events of one topic
        (a call's events are never split across batches unless they alone exceed the
        limit), skipping a sequence number at each gap."""
        limit = self.options.max_batch_events
        batch: list[KVCacheEvent] = []
        topic = self._topic
        for item in items:
            if isinstance(item, _Gap):
                self._emit(batch, encoder, topic)
                batch = []
                with self._lock:
                    self._seq += 1
                    self._skipped += 1
                continue
            frame, events = item
            if batch and (len(batch) + len(events) > limit or frame != topic):
                self._emit(batch, encoder, topic)
                batch = []
            topic = frame
            batch.extend(events)
            while len(batch) > limit:
                self._emit(batch[:limit], encoder, topic)
                batch = batch[limit:]
        self._emit(batch, encoder, topic)

    def _emit(
        self, events: list[KVCacheEvent], encoder: msgspec.msgpack.Encoder, topic: bytes
    ) -> None:
        if not events:
            return
        payload = encoder.encode(
            EventBatch(
                ts=time.time(), events=events, data_parallel_rank=self.options.data_parallel_rank
            )
        )
        with self._lock:
            seq = self._seq
            self._seq += 1
        seq_bytes = seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((topic, seq_bytes, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no room for this message (a connecting PUB with its peer away): dropped, the gap shows
        if self._router is not None:
            self._replay.keep(seq, topic, payload)
        with self._lock:
            self._held -= len(events)
            self._published_events += len(events)
            self._published_batches += 1
