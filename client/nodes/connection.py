"""One client's connection to one storage node: PUT and GET batches.

``NodeConnection`` (here) speaks UCX (any host); ``ShmConnection``
(``client.nodes.shm_connection``) speaks the same frames over a Unix socket to a node on this
host and moves pages through shared memory (kvstore.wire.shm). Both verify every page
they receive against the index's checksum, and hash only the pages a node asks for on
a put. ``Connection`` (here) is the request discipline they share; what a call carries
and returns (pages, outcomes, refusals, request frames) is ``client.nodes.calls``.

Requests on a connection are serialised (control frames and payloads must stay in
order). A clean refusal (an ERROR frame) raises ``NodeRefusedError`` and keeps the
connection; any other failure, a timeout included, closes it before it raises
``TransportError``, so nothing can land in the caller's memory after the call has
returned. The caller treats the node's pages as missing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from client.memory.buffers import Span, adjacent, joined, split_spans
from client.memory.copy_plans import PageCopies
from client.memory.device_pages import DeviceCopier
from client.memory.device_rows import DeviceRows
from client.memory.staging import host_buffers
from client.nodes.calls import (
    Checksums,
    ClosedBeforeUseError,
    Expected,
    GetOutcome,
    NodeRefusedError,
    OutgoingPage,
    PutOutcome,
    get_request,
    put_request,
)
from kvstore.errors import ProtocolError, TransportError
from kvstore.index import NodeInfo
from kvstore.pages.checksum import checksums, copy_checksummed
from kvstore.pages.keys import NamespaceKey
from kvstore.wire import protocol as P
from kvstore.wire.transport import Channel, connect, started, with_timeout


class Connection:
    """What both data paths share: the lock, the guard that closes on failure, frames.
    Subclasses (one per path) implement ``_open``, ``_put``, ``_get`` and ``close``."""

    path = ""

    def __init__(self, node: NodeInfo, token: str, device: DeviceCopier | None = None) -> None:
        self.node = node
        self.token = token
        self.device = device  # lands pages in device memory (client.memory.device_pages)
        self._lock = asyncio.Lock()
        self.broken = False
        self._borrowed: list[np.ndarray] = []  # pool blocks of the request in flight (``_borrow``)

    async def put(
        self,
        namespace: NamespaceKey,
        pages: list[OutgoingPage],
        checksum: Checksums,
        timeout: float,
    ) -> PutOutcome:
        """Offer ``pages``; send only those the node wants (hashed only then)."""
        return await self._guarded(self._put(namespace, pages, checksum), timeout, "put")

    async def get(
        self,
        namespace: NamespaceKey,
        hashes: list[bytes],
        sinks: list[Span] | DeviceRows,
        expected: Expected,
        timeout: float,
        probe: bool = False,
        slots: np.ndarray | None = None,
    ) -> GetOutcome:
        """Fetch pages into ``sinks`` (host spans, or device spans of ``device``) and
        verify each against ``expected`` (the index's checksums); a ``probe`` (client
        start's warm-up) is left out of the node's counters. ``slots``: the pages' pool
        slots in the index, which a same-host get into device memory reads straight."""
        if isinstance(sinks, DeviceRows):
            work = self._get_device(namespace, hashes, sinks, expected, slots)
        else:
            work = self._get(namespace, hashes, sinks, expected, probe)
        return await self._guarded(work, timeout, "get")

    async def _get_device(
        self,
        namespace: NamespaceKey,
        hashes: list[bytes],
        sinks: DeviceRows,
        expected: Expected,
        slots: np.ndarray | None = None,
    ) -> GetOutcome:
        """Fetch pages into device spans of the client's copier and verify each (each
        path its own way; ``slots``: the index's, for a path that reads them straight)."""
        raise NotImplementedError

    def _device_copier(self) -> DeviceCopier:
        """The client's device copier; a get into device memory is made only with one."""
        if self.device is None:
            raise ProtocolError("a get into device memory needs the client's device copier")
        return self.device

    async def _guarded(self, work: Any, timeout: float, what: str) -> Any:
        async with self._lock:
            if self.broken:
                work.close()
                raise ClosedBeforeUseError(f"connection to {self.node.node_id} is closed")
            settled = False  # no request of this call can still touch its buffers
            try:
                await self._open(timeout)
                result = await with_timeout(work, timeout, f"{what} on {self.node.node_id}")
                settled = True
                return result
            except NodeRefusedError as exc:
                if exc.code is P.RefusalCode.UNAUTHORIZED:  # the node closed its side
                    await self.close()
                settled = True
                raise
            except BaseException as exc:
                work.close()  # not started when the connect failed; a no-op otherwise
                await self.close()  # every request of the call has finished: nothing lands later
                settled = True
                if isinstance(exc, (TransportError, asyncio.CancelledError)):
                    raise
                raise TransportError(f"{what} on {self.node.node_id} failed: {exc!r}") from exc
            finally:
                borrowed, self._borrowed = self._borrowed, []
                if settled:  # else left to the garbage collector, out of the pool
                    for buf in borrowed:
                        host_buffers().give_buffer(buf)

    def _borrow(self, nbytes: int) -> np.ndarray:
        """Host memory from the pool for this request (packed runs, scratch), given back
        once no request of the call can touch it (``_guarded``)."""
        buf = host_buffers().take_buffer(nbytes)
        self._borrowed.append(buf)
        return buf

    def _check_frame(self, frame: Any, expected: type) -> Any:
        if isinstance(frame, P.ErrorFrame):
            raise NodeRefusedError(self.node.node_id, frame.code, frame.message)
        if not isinstance(frame, expected):
            raise ProtocolError(
                f"node {self.node.node_id} sent {type(frame).__name__}, expected {expected.__name__}"
            )
        return frame

    def _check_put_plan(self, plan: P.PutPlan, count: int) -> list[int]:
        wanted = plan.ints("wanted")
        if any(not 0 <= i < count for i in wanted) or (
            plan.runs.size and int(plan.runs.sum()) != len(wanted)
        ):
            raise ProtocolError(f"node {self.node.node_id} sent an inconsistent put plan")
        return wanted

    async def _open(self, timeout: float) -> None:
        raise NotImplementedError

    async def _put(
        self, namespace: NamespaceKey, pages: list[OutgoingPage], checksum: Checksums
    ) -> PutOutcome:
        raise NotImplementedError

    async def _get(
        self,
        namespace: NamespaceKey,
        hashes: list[bytes],
        sinks: list[Span],
        expected: Expected,
        probe: bool,
    ) -> GetOutcome:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


# Runs whose receives are posted before the first has landed: a window, so a get of
# scattered pages into scattered memory holds at most this many scratch buffers.
RECEIVES_AHEAD = 8


async def _landed(
    received: asyncio.Future, scratch: np.ndarray | None, spans: list[Span] | None
) -> list[int] | None:
    """Wait for one run's receive; scatter it from ``scratch`` into ``spans`` (None:
    the run's pages do not fit the caller's, and are dropped). Returns each page's
    xxh3 as it landed, for verification: of the spans themselves when the run landed
    in place (no scratch), else of the scratch, hashed chunk by chunk as it is copied
    out (``copy_checksummed``: one pass over the bytes while they are in cache)."""
    await asyncio.shield(received)
    if spans is None:
        return None
    if scratch is None:
        return checksums([s.view() for s in spans])
    off, pairs = 0, []
    for s in spans:
        pairs.append((s.bytes(), scratch[off : off + s.nbytes]))
        off += s.nbytes
    return copy_checksummed(pairs, hash_source=True)


class NodeConnection(Connection):
    """A node over UCX."""

    path = "ucx"

    def __init__(
        self, node: NodeInfo, token: str, ucxx: Any, device: DeviceCopier | None = None
    ) -> None:
        super().__init__(node, token, device)
        self._ucxx = ucxx
        self._ep: Channel | None = None

    async def _open(self, timeout: float) -> None:
        if self._ep is None:
            self._ep = await connect(
                self._ucxx,
                self.node.host,
                self.node.port,
                timeout,
                f"connect to {self.node.node_id}",
            )

    def _channel(self) -> Channel:
        """The endpoint ``_open`` made; requests run only after it (``_guarded``)."""
        if self._ep is None:
            raise TransportError(f"connection to {self.node.node_id} is not open")
        return self._ep

    async def _recv_frame(self, expected: type) -> Any:
        return self._check_frame(P.decode(await self._channel().recv_frame()), expected)

    async def _put(
        self, namespace: NamespaceKey, pages: list[OutgoingPage], checksum: Checksums
    ) -> PutOutcome:
        ep = self._channel()
        # as a get: the plan's receive is posted first, and the request's send completion
        # is awaited with it; the pages are hashed meanwhile (the node usually wants them all)
        plan_arrives = started(self._recv_frame(P.PutPlan))
        request_sent = ep.post_frame(
            put_request(namespace, self.token, pages, self.node.extra.get("put_tokens") == "1")
        )
        ahead = checksum.ahead(pages)
        try:
            await asyncio.shield(asyncio.gather(*request_sent))
            plan: P.PutPlan = await plan_arrives
        finally:
            ahead.stop()
        wanted = self._check_put_plan(plan, len(pages))
        # the checksums and every run are posted at once and awaited together (awaiting
        # each send cost about 1 ms through ucxx's threads: ``Channel.post_send``)
        result_arrives = started(self._recv_frame(P.PutResult))
        # Runs whose pages do not touch (insert's scattered pages, small pages) are
        # packed first, copied and hashed in one pass on two threads (copy_checksummed),
        # so their checksums are known before the checksums frame leaves.
        bufs, packing, pos = [], [], []
        start = 0
        for run in plan.ints("runs"):
            idx = wanted[start : start + run]
            spans = [pages[i].span for i in idx]
            if adjacent(spans):
                bufs.append(joined(spans))
            else:
                buf = self._borrow(sum(s.nbytes for s in spans))
                at = 0
                for i in idx:
                    packing.append((buf[at : at + pages[i].span.nbytes], pages[i].span.bytes()))
                    pos.append(i)
                    at += pages[i].span.nbytes
                bufs.append(buf)
            start += run
        for i, digest in zip(pos, copy_checksummed(packing, hash_source=True)):
            checksum.record(pages[i], digest)
        sends = ep.post_frame(
            P.PutChecksums(
                checksums=np.array(checksum.of([pages[i] for i in wanted]), dtype=np.uint64)
            )
        )
        sends.extend(ep.post_send(buf, P.DATA_TAG) for buf in bufs)
        sent = sum(buf.nbytes for buf in bufs)
        await asyncio.shield(asyncio.gather(*sends))
        result: P.PutResult = await result_arrives
        return PutOutcome(result.ints("stored"), plan.ints("present"), plan.ints("refused"), sent)

    async def _get_device(
        self,
        namespace: NamespaceKey,
        hashes: list[bytes],
        sinks: DeviceRows,
        expected: Expected,
        slots: np.ndarray | None = None,
    ) -> GetOutcome:
        """A get into device memory through host memory: the pages land in pinned host
        buffers of the pool (checked there as on any get), and each run's intact pages
        are copied to the device as soon as they are checked, while later runs still
        arrive (measured on an H200 with one copy at the end: 0.96x the rate of the same
        get into host memory, the copy's 4.9 ms of 126)."""
        device = self._device_copier()
        host = self._borrow(len(sinks) * sinks.nbytes)
        spans = split_spans(host, [sinks.nbytes] * len(sinks))

        async def to_device(intact: list[int]) -> None:
            if intact:
                copies = PageCopies.of([(sinks[i], spans[i]) for i in intact])
                await device.land(copies)

        return await self._get(namespace, hashes, spans, expected, False, to_device)

    async def _get(
        self,
        namespace: NamespaceKey,
        hashes: list[bytes],
        sinks: list[Span],
        expected: Expected,
        probe: bool,
        checked: Callable[[list[int]], Awaitable[None]] | None = None,
    ) -> GetOutcome:
        """``Connection.get`` over UCX; ``checked``, when given, is handed each run's
        intact pages once they are verified (the device path copies them on)."""
        ep = self._channel()
        # the plan's receive is posted before the request leaves, so the wait for the
        # request's send completion (about 1 ms through ucxx's threads) overlaps the node's work
        plan_arrives = started(self._recv_frame(P.GetPlan))
        await ep.send_frame(get_request(namespace, self.token, hashes, sinks, probe))
        plan: P.GetPlan = await plan_arrives
        present, sizes, sums, runs = (
            plan.ints("present"),
            plan.ints("sizes"),
            plan.ints("checksums"),
            plan.ints("runs"),
        )
        if (
            sum(runs) != len(present)
            or len(sizes) != len(present)
            or len(sums) != len(present)
            or any(not 0 <= i < len(hashes) for i in present)
        ):
            raise ProtocolError(f"node {self.node.node_id} sent an inconsistent get plan")
        outcome = GetOutcome([], 0)
        starts = np.cumsum([0] + runs).tolist()
        # Receives are posted RECEIVES_AHEAD runs ahead (awaiting each before posting the
        # next cost a trip through ucxx's threads per run); each run is verified while
        # later ones arrive (UCX progresses in its own thread).
        pending = [
            self._receive(ep, sinks, present, sizes, starts, r)
            for r in range(min(RECEIVES_AHEAD, len(runs)))
        ]
        for r in range(len(runs)):
            landed = await pending[r]
            if r + RECEIVES_AHEAD < len(runs):
                pending.append(self._receive(ep, sinks, present, sizes, starts, r + RECEIVES_AHEAD))
            if landed is not None:
                good = len(outcome.ok)
                for k, digest in zip(range(starts[r], starts[r + 1]), landed):
                    i = present[k]
                    outcome.check(i, sums[k], expected[i], digest)
                if checked is not None and len(outcome.ok) > good:
                    await checked(outcome.ok[good:])
        return outcome

    def _receive(
        self,
        ep: Channel,
        sinks: list[Span],
        present: list[int],
        sizes: list[int],
        starts: list[int],
        r: int,
    ) -> asyncio.Future:
        """Post the receive of run ``r`` now (so receives are posted in run order): in
        place when its pages touch in the caller's memory, else through a scratch
        buffer scattered on arrival. The future gives the run's page checksums as they
        landed, or None when they do not fit the caller's (a page of the wrong size
        never can be the one asked for)."""
        idx = present[starts[r] : starts[r + 1]]
        spans = [sinks[i] for i in idx]
        fits = all(s.nbytes == size for s, size in zip(spans, sizes[starts[r] : starts[r + 1]]))
        if fits and adjacent(spans):
            return started(
                _landed(ep.post_recv(joined(spans), P.DATA_TAG), None, spans)
            )  # lands in place
        scratch = self._borrow(sum(sizes[starts[r] : starts[r + 1]]))
        return started(_landed(ep.post_recv(scratch, P.DATA_TAG), scratch, spans if fits else None))

    async def close(self) -> None:
        """Abort the endpoint and wait until none of its requests can still touch memory."""
        self.broken = True
        ep, self._ep = self._ep, None
        if ep is not None:
            await ep.close()
