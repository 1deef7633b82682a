"""The replay window of a publisher: the batches it sent last, handed again to a
router that missed them (vLLM's replay protocol: a client sends the first sequence it
wants, 8 bytes big-endian, on a ROUTER socket; it gets ``[b"", topic, seq, payload]``
for every batch still held from that one on, then ``[b"", b"", -1, b""]``).

Owned by ``EventPublisher`` (kvstore.events.publisher) and used on its thread only."""

from __future__ import annotations

import logging
from collections import deque

import zmq

from kvstore.events.access import EventAccess
from kvstore.events.gate import user_id

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message, as vLLM sends it


class ReplayWindow:
    """At most ``max_batches`` batches and ``max_bytes`` of payload, oldest dropped
    first; ``requests`` counts the replays served."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.requests = 0
        self._batches: deque[tuple[int, bytes, bytes]] = deque()  # (sequence, topic, payload)
        self._nbytes = 0

    def keep(self, seq: int, topic: bytes, payload: bytes) -> None:
        """Add a sent batch, dropping the oldest past either bound (a batch larger than
        the byte bound is not kept)."""
        if self.max_batches == 0 or len(payload) > self.max_bytes:
            return
        self._batches.append((seq, topic, payload))
        self._nbytes += len(payload)
        while len(self._batches) > self.max_batches or self._nbytes > self.max_bytes:
            self._nbytes -= len(self._batches.popleft()[2])

    def serve(self, router: zmq.Socket, access: EventAccess | None) -> None:
        """Answer every replay request waiting on ``router``. With ``access`` (an
        authenticated stream) each router gets only the batches it may read."""
        while True:
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 3:
                log.warning(
                    "ignored a replay request of %d frames (expected identity, empty, start sequence)",
                    len(frames),
                )
                continue
            client, start = frames[0].bytes, frames[2].bytes
            key = user_id(frames[2]) if access is not None else None
            self.requests += 1
            first = int.from_bytes(start, "big")
            try:
                for seq, topic, payload in list(self._batches):
                    if seq >= first and (access is None or access.reads(key, topic)):
                        router.send_multipart(
                            (client, b"", topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                        )
                router.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("a replay client stopped reading; the rest of its replay was dropped")
