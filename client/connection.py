"""One client's connection to one storage node: PUT and GET batches over ucxx.

Requests on a connection are serialised (control frames and payloads must stay in
order). A clean refusal (an ERROR frame) raises ``NodeRefusedError`` and keeps the
endpoint; any other failure, a timeout included, closes the endpoint before it
raises ``TransportError``, so no receive can land in the caller's memory after the
call has returned. The caller treats the node's pages as missing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore import protocol as P
from kvstore.checksum import page_checksum
from kvstore.errors import ProtocolError, TransportError
from kvstore.index import NodeInfo
from kvstore.transport import Channel, connect, with_timeout
from client.buffers import Span, adjacent, join_flags, joined


class NodeRefusedError(TransportError):
    """The node answered with an ERROR frame (``code`` says why); the connection stays usable."""

    def __init__(self, node_id: str, code: str, message: str) -> None:
        super().__init__(f"node {node_id} refused: {code}: {message}")
        self.code = code


@dataclass(frozen=True, slots=True)
class OutgoingPage:
    hash: bytes
    checksum: int
    span: Span


@dataclass(frozen=True, slots=True)
class PutOutcome:
    stored: list[int]
    present: list[int]
    refused: list[int]
    bytes_sent: int


class NodeConnection:
    def __init__(self, node: NodeInfo, token: str, ucxx: Any) -> None:
        self.node = node
        self.token = token
        self._ucxx = ucxx
        self._ep: Channel | None = None
        self._lock = asyncio.Lock()
        self.broken = False

    async def _endpoint(self, timeout: float) -> Channel:
        if self._ep is None:
            self._ep = await connect(self._ucxx, self.node.host, self.node.port, timeout, f"connect to {self.node.node_id}")
        return self._ep

    async def _recv_frame(self, expected: type) -> Any:
        frame = P.decode(await self._ep.recv_frame())
        if isinstance(frame, P.ErrorFrame):
            raise NodeRefusedError(self.node.node_id, frame.code, frame.message)
        if not isinstance(frame, expected):
            raise ProtocolError(f"node {self.node.node_id} sent {type(frame).__name__}, expected {expected.__name__}")
        return frame

    async def put(self, namespace: str, pages: list[OutgoingPage], timeout: float) -> PutOutcome:
        """Offer ``pages``; send only those the node wants, in the runs it asks for."""
        return await self._guarded(self._put(namespace, pages), timeout, "put")

    async def get(self, namespace: str, hashes: list[bytes], sinks: list[Span], timeout: float) -> dict[int, int]:
        """Fetch pages into ``sinks``; returns {request index: checksum the node recorded}
        for every page received whole. Callers verify the bytes."""
        return await self._guarded(self._get(namespace, hashes, sinks), timeout, "get")

    async def _guarded(self, work: Any, timeout: float, what: str) -> Any:
        async with self._lock:
            if self.broken:
                work.close()
                raise TransportError(f"connection to {self.node.node_id} is closed")
            try:
                await self._endpoint(timeout)
                return await with_timeout(work, timeout, f"{what} on {self.node.node_id}")
            except NodeRefusedError:
                raise
            except BaseException as exc:
                work.close()  # not started when the connect failed; a no-op otherwise
                await self.close()  # every request of the call has finished: nothing lands later
                if isinstance(exc, (TransportError, asyncio.CancelledError)):
                    raise
                raise TransportError(f"{what} on {self.node.node_id} failed: {exc!r}") from exc

    async def _put(self, namespace: str, pages: list[OutgoingPage]) -> PutOutcome:
        ep = self._ep
        req = P.PutRequest(
            namespace=namespace, token=self.token,
            pages=[P.PutPage(hash=p.hash.hex(), size=p.span.nbytes, checksum=p.checksum, join=j)
                   for p, j in zip(pages, join_flags([p.span for p in pages]))],
        )
        await ep.send_frame(req)
        plan: P.PutPlan = await self._recv_frame(P.PutPlan)
        if sum(plan.runs) != len(plan.wanted) or any(not 0 <= i < len(pages) for i in plan.wanted):
            raise ProtocolError(f"node {self.node.node_id} sent an inconsistent put plan")
        pos, sent = 0, 0
        for run in plan.runs:
            buf = joined([pages[i].span for i in plan.wanted[pos : pos + run]])
            await ep.send(buf, P.DATA_TAG)
            sent += buf.nbytes
            pos += run
        result: P.PutResult = await self._recv_frame(P.PutResult)
        return PutOutcome(result.stored, plan.present, plan.refused, sent)

    async def _get(self, namespace: str, hashes: list[bytes], sinks: list[Span]) -> dict[int, int]:
        ep = self._ep
        pages = [P.GetPage(hash=h.hex(), join=j) for h, j in zip(hashes, join_flags(sinks))]
        req = P.GetRequest(namespace=namespace, token=self.token, pages=pages)
        await ep.send_frame(req)
        plan: P.GetPlan = await self._recv_frame(P.GetPlan)
        if sum(plan.runs) != len(plan.present) or len(plan.sizes) != len(plan.present):
            raise ProtocolError(f"node {self.node.node_id} sent an inconsistent get plan")
        received: dict[int, int] = {}
        pos = 0
        for run in plan.runs:
            idx = plan.present[pos : pos + run]
            sizes = plan.sizes[pos : pos + run]
            spans = [sinks[i] for i in idx]
            fits = all(s.nbytes == size for s, size in zip(spans, sizes))
            if fits and adjacent(spans):
                await ep.recv(joined(spans), P.DATA_TAG)
            else:
                scratch = np.empty(sum(sizes), dtype=np.uint8)
                await ep.recv(scratch, P.DATA_TAG)
                if not fits:  # a page of the wrong size can never be the page we asked for
                    pos += run
                    continue
                off = 0
                for s in spans:
                    s.view()[:] = scratch[off : off + s.nbytes]
                    off += s.nbytes
            for k, i in enumerate(idx):
                received[i] = plan.checksums[pos + k]
            pos += run
        return received

    async def close(self) -> None:
        """Abort the endpoint and wait until none of its requests can still touch memory."""
        self.broken = True
        ep, self._ep = self._ep, None
        if ep is not None:
            await ep.close()


def verify(span: Span, expected: int) -> bool:
    return page_checksum(span.view()) == expected
