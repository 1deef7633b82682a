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

import asyncio
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import zmq
import zmq.auth
from pydantic import BaseModel, ConfigDict, Field

from kvstore.events.access import EventAccess
from kvstore.events.format import EventBatch, KVCacheEvent
from kvstore.settings.config import ByteSize
from kvstore.settings.events import binds

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message, as vLLM sends it


class PublisherOptions(BaseModel):
    """How a node publishes its events (from its command line or settings)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str = Field(
        description="PUB address, e.g. tcp://*:5557 (binds) or tcp://router:5557 (connects); see mode"
    )
    mode: Literal["auto", "bind", "connect"] = Field(
        "auto",
        description=(
            "auto: bind a wildcard (tcp://*:PORT, tcp://[::]:PORT), ipc:// or inproc:// address "
            "and connect to any other, as vLLM does"
        ),
    )
    replay_endpoint: str | None = Field(
        None, description="ROUTER address (always bound) serving missed batches; None: no replay"
    )
    topic: str = Field(
        "", description="first frame of every message (kvstore.events.pool_topic gives a node's)"
    )
    max_queue_events: int = Field(
        100_000, ge=1, description="events waiting to be sent, past which publish drops (counted)"
    )
    max_batch_events: int = Field(1024, ge=1, description="events per message at most")
    replay_batches: int = Field(10_000, ge=0, description="batches kept for replay")
    replay_bytes: ByteSize = Field(64 << 20, description="payload bytes kept for replay at most")
    hwm: int = Field(
        100_000,
        ge=1,
        description=(
            "messages queued per subscriber before ZMQ drops "
            "(ZMQ's 0, no limit, is refused: a slow subscriber would grow memory)"
        ),
    )
    data_parallel_rank: int | None = Field(
        None, ge=0, description="set in every batch when given (engines set it; a node does not)"
    )
    close_linger_ms: int = Field(
        500, ge=0, description="how long close() lets ZMQ deliver what it already queued"
    )


@dataclass(frozen=True)
class PublisherStats:
    """Counts since the publisher started (``EventPublisher.stats``)."""

    published_events: int
    published_batches: int
    dropped_events: (
        int  # by publish, on a full queue (the PUB socket's own drops are not seen here)
    )
    next_sequence: int  # the sequence number the next batch gets (gaps included)
    skipped_sequences: int  # numbers no batch got: one per run of dropped publish calls
    replay_requests: int
    queued_events: int
    refused_handshakes: int = 0  # connections without a CURVE handshake this node accepts
    refused_keys: int = 0  # CURVE handshakes of a key the routers file does not list
    refused_subscriptions: int = 0  # subscriptions to topics of no tenant the router reads
    rebinds: int = 0  # times a narrowed routers file made every router handshake again


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
        self._access = access
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
        self._published_events = self._published_batches = self._dropped = self._replays = (
            self._skipped
        ) = 0
        self._refused = {"handshake": 0, "key": 0, "subscription": 0}
        self._rebinds = 0
        self._seq = 0
        self._replay: deque[tuple[int, bytes, bytes]] = deque()  # (sequence, topic, payload)
        self._replay_nbytes = 0
        self._topic = options.topic.encode()
        self._ctx = zmq.Context(io_threads=1)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._auth: zmq.auth.Authenticator | None = None
        self._monitors: list[zmq.Socket] = []
        self._router: zmq.Socket | None = None
        try:
            if access is not None:
                if not _binds(options.endpoint, options.mode):
                    raise ValueError(
                        f"an authenticated event stream binds its sockets (routers connect and "
                        f"handshake): {options.endpoint} would connect"
                    )
                self._auth = zmq.auth.Authenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve_callback(_ZAP_DOMAIN, credentials_provider=self)
            self._binds = _binds(options.endpoint, options.mode)  # before a port 0 resolves
            self.endpoint = options.endpoint
            self.replay_endpoint: str | None = options.replay_endpoint
            self._open_sockets()
        except Exception:
            self._close_sockets()
            if self._auth is not None:
                self._auth.stop()
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
        self._pub = self._ctx.socket(zmq.PUB if self._access is None else zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, opts.hwm)
        self._secure(self._pub)
        if self._access is not None:
            self._pub.setsockopt(zmq.XPUB_MANUAL, 1)
        self.endpoint = self._attach(self._pub, self.endpoint, self._binds)
        if self.replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, opts.hwm)
            self._secure(self._router)
            self.replay_endpoint = self._attach(self._router, self.replay_endpoint, True)

    def _secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server checked by the ZAP handler, watched for refused
        handshakes (a no-op without access rules)."""
        if self._access is None:
            return
        sock.curve_server = True
        sock.curve_publickey = self._access.keys.public
        sock.curve_secretkey = self._access.keys.secret
        sock.zap_domain = _ZAP_DOMAIN.encode()
        self._monitors.append(sock.get_monitor_socket(_REFUSALS))

    def _close_sockets(self, linger: int = 0) -> None:
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._monitors = []
        if getattr(self, "_pub", None) is not None:
            self._pub.close(linger=linger)
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question for each CURVE handshake (pyzmq's credentials
        provider interface): may the router with public ``key`` (Z85) connect?"""
        assert self._access is not None
        return self._access.admits(key.decode("ascii"))

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
        with self._lock:
            return PublisherStats(
                self._published_events,
                self._published_batches,
                self._dropped,
                self._seq,
                self._skipped,
                self._replays,
                self._held,
                self._refused["handshake"],
                self._refused["key"],
                self._refused["subscription"],
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
        if self._auth is not None:
            self._auth.stop()
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
        timeout = None if self._access is None else 1000
        generation = self._access.generation() if self._access is not None else 0
        rebind_due = False  # a rebind failed: tried again each second
        while True:
            ready = dict(poller.poll(timeout))
            if self._access is not None:
                self._serve_access(ready)
                if self._access.generation() != generation or rebind_due:
                    generation = self._access.generation()
                    rebind_due = not self._rebind()
                    poller = self._poller()
            if self._router is not None and ready.get(self._router):
                self._serve_replays()
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
        if self._auth is not None:
            poller.register(self._auth.zap_socket, zmq.POLLIN)
            poller.register(self._pub, zmq.POLLIN)  # subscriptions, for the XPUB to decide
            for monitor in self._monitors:
                poller.register(monitor, zmq.POLLIN)
        return poller

    def _serve_access(self, ready: dict) -> None:
        """Answer the ZAP handshakes, decide the subscriptions and count the refused
        handshakes that are waiting (an authenticated stream only)."""
        assert self._auth is not None and self._access is not None
        if ready.get(self._auth.zap_socket):
            while True:
                try:
                    request = self._auth.zap_socket.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                # pyzmq's handler is a coroutine; with a plain callback it never waits
                asyncio.run(self._auth.handle_zap_message(request))
        if ready.get(self._pub):
            self._serve_subscriptions()
        for monitor in self._monitors:
            if ready.get(monitor):
                while True:
                    try:
                        frames = monitor.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    event = int.from_bytes(frames[0][:2], "little")
                    reason = "key" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "handshake"
                    with self._lock:
                        self._refused[reason] += 1
                    log.info(
                        "KV events: refused a connection on %s (%s)",
                        frames[1].decode(errors="replace"),
                        "a key no router holds" if reason == "key" else "no CURVE handshake",
                    )

    def _serve_subscriptions(self) -> None:
        """Subscribe each router to what ``EventAccess.grants`` gives it for what it
        asked (XPUB_MANUAL: a subscription applies to the pipe last read from)."""
        assert self._access is not None
        while True:
            try:
                frame = self._pub.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            data = frame.bytes
            if not data or data[0] not in (0, 1):
                continue
            grants = self._access.grants(_user_id(frame), data[1:])
            if data[0] == 1 and not grants:
                with self._lock:
                    self._refused["subscription"] += 1
                log.info(
                    "KV events: refused a subscription to %r (no tenant it may read)", data[1:]
                )
            for prefix in grants:
                self._pub.setsockopt(zmq.SUBSCRIBE if data[0] == 1 else zmq.UNSUBSCRIBE, prefix)

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
        self._keep(seq, topic, payload)
        with self._lock:
            self._held -= len(events)
            self._published_events += len(events)
            self._published_batches += 1

    def _keep(self, seq: int, topic: bytes, payload: bytes) -> None:
        """Add a batch to the replay window, dropping the oldest past either bound."""
        opts = self.options
        if self._router is None or opts.replay_batches == 0 or len(payload) > opts.replay_bytes:
            return
        self._replay.append((seq, topic, payload))
        self._replay_nbytes += len(payload)
        while len(self._replay) > opts.replay_batches or self._replay_nbytes > opts.replay_bytes:
            self._replay_nbytes -= len(self._replay.popleft()[2])

    def _serve_replays(self) -> None:
        """Answer every replay request waiting, from the replay window (an
        authenticated stream sends each router only the batches it may read)."""
        assert self._router is not None
        access = self._access
        while True:
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 3:
                log.warning(
                    "ignored a replay request of %d frames (expected identity, empty, start sequence)",
                    len(frames),
                )
                continue
            client, start = frames[0].bytes, frames[2].bytes
            key = _user_id(frames[2]) if access is not None else None
            with self._lock:
                self._replays += 1
            first = int.from_bytes(start, "big")
            try:
                for seq, topic, payload in list(self._replay):
                    if seq >= first and (access is None or access.reads(key, topic)):
                        self._router.send_multipart(
                            (client, b"", topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                        )
                self._router.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("a replay client stopped reading; the rest of its replay was dropped")


_ZAP_DOMAIN = "kvstore-events"
# handshakes refused: no or a broken CURVE handshake, and keys the ZAP handler refused
_REFUSALS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZAP user id of the connection ``frame`` came on (a router's public key)."""
    try:
        value = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return value if isinstance(value, str) else None
