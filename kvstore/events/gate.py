"""The guard of an authenticated event stream, run on the publisher's thread: CURVE
on the publisher's sockets, ZAP answers from ``EventAccess``, each router's
subscriptions decided, and refused handshakes counted.

``EventPublisher`` (kvstore.events.publisher) builds a ``Gate`` when it is given an
``EventAccess``, has it ``secure`` every socket it binds, registers what ``register``
adds with its poller and hands what became ready to ``serve``. pyzmq's
``zmq.auth.Authenticator`` speaks the ZAP protocol; its socket is polled here rather
than in a thread of its own, so an idle stream still has one thread, asleep."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import zmq
import zmq.auth

from kvstore.events.access import EventAccess

log = logging.getLogger(__name__)
ZAP_DOMAIN = "kvstore-events"
# handshakes refused: no or a broken CURVE handshake, and keys the ZAP handler refused
_REFUSALS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
REASONS = ("handshake", "key", "subscription")


class Gate:
    """Authentication and per-router subscriptions of one publisher's sockets. Called
    from the publisher's thread, except ``refused`` (any thread)."""

    def __init__(self, ctx: zmq.Context, access: EventAccess) -> None:
        self.access = access
        self._lock = threading.Lock()
        self._refused = dict.fromkeys(REASONS, 0)
        self._monitors: list[zmq.Socket] = []
        self._counted_at = 0.0  # monotonic time the monitors were last read
        self._auth = zmq.auth.Authenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question for each CURVE handshake (pyzmq's credentials
        provider interface): may the router with public ``key`` (Z85) connect?"""
        return self.access.admits(key.decode("ascii"))

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CURVE server whose handshakes the ZAP
        handler checks, watched for refused handshakes."""
        sock.curve_server = True
        sock.curve_publickey = self.access.keys.public
        sock.curve_secretkey = self.access.keys.secret
        sock.zap_domain = ZAP_DOMAIN.encode()
        self._monitors.append(sock.get_monitor_socket(_REFUSALS))

    def forget_sockets(self) -> None:
        """The publisher closes its sockets: count what their monitors hold, close them."""
        for monitor in self._monitors:
            self._refusals(monitor)
            monitor.close(linger=0)
        self._monitors = []

    def register(self, poller: zmq.Poller, pub: zmq.Socket) -> None:
        """Add the ZAP socket and the XPUB's subscriptions to ``poller``. The monitors
        are not polled: each socket in a poll costs every wake-up of a busy publisher
        (measured: 12-19 us a wake with the pipe alone, 24-28 us with six sockets), so
        ``serve`` reads them at most once a second."""
        poller.register(self._auth.zap_socket, zmq.POLLIN)
        poller.register(pub, zmq.POLLIN)

    def serve(self, ready: dict, pub: zmq.Socket) -> None:
        """Answer the ZAP handshakes and decide the subscriptions among what ``ready``
        (a poll's result) holds; count the refused handshakes once a second (the
        publisher wakes at least that often)."""
        if ready.get(self._auth.zap_socket):
            while True:
                try:
                    request = self._auth.zap_socket.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                # pyzmq's handler is a coroutine; with a plain callback it never waits
                asyncio.run(self._auth.handle_zap_message(request))
        if ready.get(pub):
            self._subscriptions(pub)
        now = time.monotonic()
        if now - self._counted_at >= 1.0:
            self._counted_at = now
            for monitor in self._monitors:
                self._refusals(monitor)

    def refused(self) -> dict[str, int]:
        """Refusals so far, by reason: ``handshake`` (no or a broken CURVE handshake),
        ``key`` (a key no router holds), ``subscription`` (no topic it may read)."""
        with self._lock:
            return dict(self._refused)

    def stop(self) -> None:
        self.forget_sockets()
        self._auth.stop()

    def _subscriptions(self, pub: zmq.Socket) -> None:
        """Subscribe each router to what ``EventAccess.grants`` gives it for what it
        asked (XPUB_MANUAL: a subscription applies to the pipe last read from)."""
        while True:
            try:
                frame = pub.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            data = frame.bytes
            if not data or data[0] not in (0, 1):
                continue
            grants = self.access.grants(user_id(frame), data[1:])
            if data[0] == 1 and not grants:
                self._count("subscription")
                log.info(
                    "KV events: refused a subscription to %r (no tenant it may read)", data[1:]
                )
            for prefix in grants:
                pub.setsockopt(zmq.SUBSCRIBE if data[0] == 1 else zmq.UNSUBSCRIBE, prefix)

    def _refusals(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event = int.from_bytes(frames[0][:2], "little")
            reason = "key" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "handshake"
            self._count(reason)
            log.info(
                "KV events: refused a connection on %s (%s)",
                frames[1].decode(errors="replace"),
                "a key no router holds" if reason == "key" else "no CURVE handshake",
            )

    def _count(self, reason: str) -> None:
        with self._lock:
            self._refused[reason] += 1


def user_id(frame: zmq.Frame) -> str | None:
    """The ZAP user id of the connection ``frame`` came on (a router's public key)."""
    try:
        value = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return value if isinstance(value, str) else None
