"""A storage node's KV events read back through vLLM's replay protocol, as an
authenticated router reads them (tests/server/test_node_events.py; Dynamo's tests in
tests/dynamo/ read a store's that way too)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvstore.events import END_SEQ
from tests.support.helpers import RouterKeys

# skips the importing module (or the test that imports this) where vLLM is missing
kv_events = pytest.importorskip("vllm.distributed.kv_events")

KEYS = RouterKeys()  # the router every replay here reads as, unless told otherwise


def replay(
    port: int, start: int = 0, timeout: float = 10.0, keys: RouterKeys | None = KEYS
) -> list[tuple[str, int, object]]:
    """Every batch the node still holds from ``start`` on, as (topic, sequence, vLLM
    KVEventBatch), through vLLM's replay protocol (as the router ``keys``; None: a
    node that publishes unauthenticated)."""
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if keys is not None:
        keys.client(sock)
    sock.connect(f"tcp://127.0.0.1:{port}")
    out = []
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise AssertionError("the replay did not end")
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((topic.decode(), int.from_bytes(seq, "big"), decoder.decode(payload)))
    finally:
        sock.close(linger=0)
        ctx.term()
