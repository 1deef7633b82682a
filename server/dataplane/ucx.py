"""The UCX path: a client on any host, over a UCX endpoint.

A put's pages are received straight into their pool slots and a get's sent straight
from them, pages in adjacent slots grouped into runs of one message each. Every
receive and send is posted at once and awaited together: a completion reaches
asyncio through ucxx's threads, about 1 ms per await (``Channel.post_send``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from pydantic import BaseModel

from kvstore.wire import protocol as P
from kvstore.wire.transport import Channel, started, with_timeout
from server.dataplane.batch import PutBatch
from server.dataplane.connection import Connection
from server.dataplane.errors import Broken
from server.page import StoredPage
from server.pool import MemoryPool

# Seconds a connection closed after an error reply waits for the peer (``linger``).
LINGER = 1.0


class UcxConnection(Connection):
    """A client over a UCX endpoint: moves a request's pages between the wire and the
    pool's slots, run by run."""

    path = "ucx"

    def __init__(
        self, channel: Channel, pool: MemoryPool, frame_seconds: float, timeout: float
    ) -> None:
        super().__init__(frame_seconds, timeout)
        self.channel = channel
        self.pool = pool

    async def recv(self, first_timeout: float | None = None) -> tuple[bytes, list[int]]:
        return await self.channel.recv_frame(
            rest_timeout=self.frame_seconds, first_timeout=first_timeout
        ), []

    async def _send_frame(self, frame: BaseModel, fds: list[int]) -> None:
        await self.channel.send_frame(frame)

    async def linger(self) -> None:
        """Wait until the peer closes or sends anything, at most ``LINGER`` seconds.
        ucxx's close is an abort, which drops what UCX has not written out yet:
        measured, a protocol error answered just before the abort reached the client
        in only some of 11 tries."""
        landed = self.channel.post_recv(np.empty(1, dtype=np.uint8), P.CONTROL_TAG)
        await asyncio.wait([landed], timeout=LINGER)

    async def close(self) -> None:
        await self.channel.close()

    # ---- PUT -----------------------------------------------------------------------------

    async def send_put_plan(self, batch: PutBatch) -> None:
        """Group the wanted pages into runs, post the plan, then every run's receive
        straight into its slots at once (in run order, so they match the client's
        messages in order; posting one after the other landed cost a trip through
        ucxx's threads per run). The plan's send is awaited only once the checksums
        are in (``plan_delivered``): waiting for its completion first cost about 1 ms
        per put."""
        join = [bool(batch.req.join[i]) for i in batch.wanted]
        batch.runs = P.group_runs(
            _offsets(batch.pages),
            [p.size for p in batch.pages],
            join,
            batch.wanted,
            P.DEFAULT_MAX_RUN_BYTES,
        )
        batch.plan_sent = self.channel.post_frame(P.PutPlan(**batch.plan_fields()))
        starts = np.cumsum([0, *batch.runs]).tolist()
        batch.landing = [
            (starts[r], starts[r + 1], self._receive_run(batch.pages[starts[r] : starts[r + 1]]))
            for r in range(len(batch.runs))
        ]

    async def plan_delivered(self, batch: PutBatch) -> None:
        if batch.plan_sent:
            try:
                await with_timeout(
                    asyncio.shield(asyncio.gather(*batch.plan_sent)), self.timeout, "put plan"
                )
            except Exception as exc:
                raise Broken(f"cannot send the put plan: {exc}") from exc

    async def arrived(self, batch: PutBatch) -> AsyncIterator[tuple[int, int]]:
        """Each run once it has landed, while later ones arrive (UCX progresses in its
        own thread)."""
        for start, end, landed in batch.landing:
            await landed
            yield start, end

    def _receive_run(self, group: list[StoredPage]) -> asyncio.Future[Any]:
        """Post the receive of one run straight into its pool slots now; the future
        raises ``Broken`` on any failure."""
        received = self.channel.post_recv(self._run_view(group), P.DATA_TAG)

        async def landed() -> None:
            try:
                await with_timeout(asyncio.shield(received), self.timeout, "page receive")
            except Exception as exc:
                raise Broken(f"page receive of {len(group)} pages failed: {exc}") from exc

        return started(landed())

    # ---- GET -------------------------------------------------------------------------------

    async def send_pages(
        self,
        req: P.GetRequest,
        present: list[int],
        pages: list[StoredPage],
        sizes: list[int],
        checksums: np.ndarray,
        more: bool = False,
    ) -> int:
        """Post the plan and every run's message out of the pool at once, then wait for
        all of them: the client posts each run's receive as the plan tells it, and a
        run whose receive is not posted yet waits in UCX (rendezvous) or is buffered
        (small, eager). Awaiting the plan before the payload cost about a millisecond
        per get here (``Channel.post_send``)."""
        runs = P.group_runs(
            _offsets(pages), sizes, [bool(req.join[i]) for i in present], present, req.max_run_bytes
        )
        starts = np.cumsum([0, *runs]).tolist()
        sends = self.channel.post_frame(
            P.GetPlan(
                present=present, sizes=sizes, checksums=checksums, runs=runs, regions=[], offsets=[]
            )
        )
        for r in range(len(runs)):
            sends.append(
                self.channel.post_send(self._run_view(pages[starts[r] : starts[r + 1]]), P.DATA_TAG)
            )
        try:
            await with_timeout(asyncio.shield(asyncio.gather(*sends)), self.timeout, "get reply")
        except Exception as exc:
            raise Broken(
                f"sending the plan and {len(runs)} runs of {len(pages)} pages failed: {exc}"
            ) from exc
        return len(runs)

    def _run_view(self, group: list[StoredPage]) -> np.ndarray:
        """The pool bytes of a run: pages that lie back to back in their slots."""
        first, last = group[0].offset, group[-1].offset
        assert first is not None and last is not None  # pinned pages hold their slots
        return self.pool.view(first, last + group[-1].size - first)


def _offsets(pages: list[StoredPage]) -> list[int]:
    """The memory slots of pages a transfer moves (pinned, each holds one)."""
    return [p.offset for p in pages]  # type: ignore[misc]  # not re-checked: a get may name 65,536 pages
