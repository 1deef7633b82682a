"""The same-host path: a client on the node's host, over a Unix socket.

Pages move through shared memory: the client maps the pool's slabs it is lent
(server/dataplane/lending.py) and copies a put's pages into their slots, or a get's
out of them, itself. Descriptors the client sends are refused (kvstore.wire.shm)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
from pydantic import BaseModel

from kvstore.wire import protocol as P
from kvstore.wire import shm
from server.dataplane.batch import PutBatch
from server.dataplane.connection import Connection
from server.dataplane.lending import SlabLender
from server.page import StoredPage
from server.store import PageStore

# A same-host client's start probe is also lent (read-only) the slabs its tenant holds
# pages in, the newest first, up to this many bytes of them: the client maps them at
# start instead of in its first get. Measured, a fresh engine's first load of 120 MiB
# (8 slabs of 16 MiB) spent 7-11 ms mapping them; mapping costs the client page tables
# (2 MiB per GiB faulted in), so it stops here and later slabs map on first use.
PROBE_MAP_BYTES = 1 << 30


class ShmConnection(Connection):
    """A same-host client over a Unix socket: lends it the slabs a request's pages lie
    in, and the client moves the bytes."""

    path = "shm"
    plans_in_parts = True

    def __init__(
        self, channel: shm.UnixChannel, store: PageStore, frame_seconds: float, timeout: float
    ) -> None:
        super().__init__(frame_seconds, timeout)
        self.channel = channel
        self.store = store
        self.lender = SlabLender(store)

    async def recv(self, first_timeout: float | None = None) -> tuple[bytes, list[int]]:
        return await self.channel.recv_frame(
            rest_timeout=self.frame_seconds, first_timeout=first_timeout
        )

    async def _send_frame(self, frame: BaseModel, fds: list[int]) -> None:
        await self.channel.send_frame(frame, fds)

    async def linger(self) -> None:
        """Nothing to wait for: what was written to a Unix socket stays readable after close."""

    async def close(self) -> None:
        self.channel.close()

    async def send_put_plan(self, batch: PutBatch) -> None:
        """The plan with writable descriptors: the client writes the wanted pages into their slots."""
        await self.lender.lend(self, P.PutPlan, batch.plan_fields(), batch.pages, writable=True)

    async def plan_delivered(self, batch: PutBatch) -> None:
        """Sent already: ``send_put_plan`` waited for it."""

    async def arrived(self, batch: PutBatch) -> AsyncIterator[tuple[int, int]]:
        """All at once: the client wrote every page into its slot before it sent the checksums."""
        yield 0, len(batch.pages)

    async def send_pages(
        self,
        req: P.GetRequest,
        present: list[int],
        pages: list[StoredPage],
        sizes: list[int],
        checksums: np.ndarray,
        more: bool = False,
    ) -> int:
        """The plan with read-only descriptors (a start probe's also lends its tenant's
        slabs), then the client's word that it copied the pages out: their pins hold
        until then. No payload message. With ``more``, this is one part of a plan sent
        in parts (``GetRequest.part_pages``): the client's word comes after the last."""
        slab = self.store.allocator.slab_size
        also = (
            self.store.allocator.slabs_of(req.tenant, max(1, PROBE_MAP_BYTES // slab))
            if req.probe
            else None
        )
        await self.lender.lend(
            self,
            P.GetPlan,
            dict(present=present, sizes=sizes, checksums=checksums),
            pages,
            writable=False,
            also=also,
            more=more,
        )
        if not more:
            await self.expect(P.GetDone, "get done")
        return 0
