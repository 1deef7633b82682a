"""Sends malformed frames to a storage node: ``python tests/raw_client.py HOST PORT``.

Prints one JSON line: the error code answered to each bad frame, and what happened
to a put whose payload was cut short."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from kvstore import protocol as P
from kvstore.checksum import page_checksum
from kvstore.transport import ensure_ucx


async def ask(ep, payload: bytes) -> str:
    await ep.am_send(payload)
    frame = P.decode(await asyncio.wait_for(ep.am_recv(), 10))
    return frame.code if isinstance(frame, P.ErrorFrame) else type(frame).__name__


async def main(host: str, port: int) -> dict:
    ucxx = ensure_ucx()
    ep = await ucxx.create_endpoint(host, port)
    good = P.encode(P.GetRequest(namespace="0" * 32, pages=[P.GetPage(hash="1" * 32)]))
    body = good[P.PREAMBLE.size :]
    cases = {
        "garbage": b"\x00\xffnot a frame at all" * 3,
        "short": b"KV",
        "bad_magic": b"XXXX" + good[4:],
        "bad_version": P.PREAMBLE.pack(P.MAGIC, 99, P.FrameType.GET_REQUEST, len(body)) + body,
        "truncated": good[:-5],
        "oversized": P.PREAMBLE.pack(P.MAGIC, P.VERSION, P.FrameType.GET_REQUEST, P.MAX_BODY_BYTES + 1),
        "unknown_type": P.PREAMBLE.pack(P.MAGIC, P.VERSION, 77, len(body)) + body,
        "bad_json": P.PREAMBLE.pack(P.MAGIC, P.VERSION, P.FrameType.GET_REQUEST, 5) + b"{nope",
        "server_frame": P.encode(P.PutResult(stored=[], corrupt=[])),
        "bad_hash": P.PREAMBLE.pack(P.MAGIC, P.VERSION, P.FrameType.GET_REQUEST, len(body)) + body.replace(b"1" * 32, b"Z" * 32),
    }
    replies = {name: await ask(ep, payload) for name, payload in cases.items()}
    replies["valid_get_after_garbage"] = await ask(ep, good)

    # A put whose payload arrives shorter than announced: the page must not be stored.
    page = np.arange(65536, dtype=np.uint8)
    put = P.PutRequest(namespace=sys.argv[3], pages=[P.PutPage(hash="2" * 32, size=page.nbytes, checksum=page_checksum(page))])
    await ep.am_send(P.encode(put))
    plan = P.decode(await ep.am_recv())
    truncated_outcome = "closed"
    try:
        await ep.send(page[:1000])
        result = P.decode(await asyncio.wait_for(ep.am_recv(), 10))
        truncated_outcome = f"stored={result.stored} corrupt={result.corrupt}"
    except Exception as exc:  # noqa: BLE001 - the server may close the endpoint instead
        truncated_outcome = f"closed: {type(exc).__name__}"
    replies["truncated_payload_plan"] = type(plan).__name__
    replies["truncated_payload"] = truncated_outcome
    return replies


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], int(sys.argv[2])))), flush=True)
