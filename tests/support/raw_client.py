"""Sends malformed frames to a storage node: ``python tests/support/raw_client.py HOST PORT NS TENANT``.

Prints one JSON line: the error code answered to each bad frame, and what happened
to a put whose payload was cut short. A bad preamble leaves the stream out of step,
so the node answers and closes the endpoint: those cases each use a fresh one."""

from __future__ import annotations

import asyncio
import json
import struct
import sys

import numpy as np

from kvstore.pages.checksum import page_checksum
from kvstore.wire import protocol as P
from kvstore.wire.transport import Channel, ensure_ucx


def first_message(data: bytes) -> np.ndarray:
    """``data`` as a first control message (padded or cut to the fixed size)."""
    data = data[: P.FIRST_MESSAGE_BYTES]
    return np.frombuffer(data + bytes(P.FIRST_MESSAGE_BYTES - len(data)), dtype=np.uint8)


async def ask(ep: Channel, data: bytes) -> str:
    await ep.send(first_message(data), P.CONTROL_TAG)
    frame = P.decode(await asyncio.wait_for(ep.recv_frame(), 10))
    return frame.code if isinstance(frame, P.ErrorFrame) else type(frame).__name__


async def main(host: str, port: int, ns_hex: str, tenant: str) -> dict:
    ucxx = ensure_ucx()
    good = P.encode(
        P.GetRequest(namespace="0" * 32, tenant="default", hashes=[b"1" * 16], join=[False])
    )
    body = good[P.PREAMBLE.size :]
    hlen = struct.unpack_from("<I", body)[0]
    too_many_rows = (
        body[: 4 + hlen] + struct.pack("<I", 5) + body[4 + hlen + 4 :]
    )  # 5 hashes announced, 1 sent
    bad_preamble = {
        "garbage": b"\x00\xffnot a frame at all" * 3,
        "short": b"KV",
        "bad_magic": b"XXXX" + good[4:],
        "bad_version": P.PREAMBLE.pack(P.MAGIC, 99, P.FrameType.GET_REQUEST, len(body)) + body,
        "oversized": P.PREAMBLE.pack(
            P.MAGIC, P.VERSION, P.FrameType.GET_REQUEST, P.MAX_BODY_BYTES + 1
        ),
    }
    bad_body = {
        "truncated": P.PREAMBLE.pack(P.MAGIC, P.VERSION, P.FrameType.GET_REQUEST, len(body) + 40)
        + body,
        "unknown_type": P.PREAMBLE.pack(P.MAGIC, P.VERSION, 77, len(body)) + body,
        "bad_json": P.PREAMBLE.pack(P.MAGIC, P.VERSION, P.FrameType.GET_REQUEST, 9)
        + struct.pack("<I", 5)
        + b"{nope",
        "server_frame": P.encode(P.PutResult(stored=[], corrupt=[])),
        "bad_rows": P.PREAMBLE.pack(P.MAGIC, P.VERSION, P.FrameType.GET_REQUEST, len(too_many_rows))
        + too_many_rows,
    }
    replies = {}
    for name, payload in bad_preamble.items():
        ep = Channel(await ucxx.create_endpoint(host, port))
        replies[name] = await ask(ep, payload)
        await ep.close()
    ep = Channel(await ucxx.create_endpoint(host, port))
    for name, payload in bad_body.items():
        replies[name] = await ask(ep, payload)
    replies["valid_get_after_garbage"] = await ask(ep, good)

    # A put whose payload arrives shorter than announced: the page must not be stored.
    page = np.arange(65536, dtype=np.uint8)
    put = P.PutRequest(
        namespace=ns_hex,
        tenant=tenant,
        hashes=[bytes.fromhex("2" * 32)],
        sizes=[page.nbytes],
        join=[False],
        anchors=[bytes.fromhex("2" * 32)],
        positions=[0],
    )
    await ep.send_frame(put)
    plan = P.decode(await ep.recv_frame())
    await ep.send_frame(P.PutChecksums(checksums=[page_checksum(page)]))
    truncated_outcome = "closed"
    try:
        await ep.send(page[:1000], P.DATA_TAG)
        result = P.decode(await asyncio.wait_for(ep.recv_frame(), 10))
        truncated_outcome = f"stored={result.stored} corrupt={result.corrupt}"
    except Exception as exc:
        truncated_outcome = f"closed: {type(exc).__name__}"
    replies["truncated_payload_plan"] = type(plan).__name__
    replies["truncated_payload"] = truncated_outcome
    return replies


if __name__ == "__main__":
    print(
        json.dumps(asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]))),
        flush=True,
    )
