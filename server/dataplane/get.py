"""Serving a GET: pin, bring into memory, send (docs/protocol.md)."""

from __future__ import annotations

import numpy as np

from kvstore.pages.hashing import HASH_BYTES
from kvstore.security.credentials import Credential
from kvstore.wire import protocol as P
from server.dataplane.auth import Authorizer
from server.dataplane.connection import Connection
from server.dataplane.namespaces import NamespaceCache
from server.dataplane.readthrough import ReadThrough
from server.metrics import NodeMetrics
from server.page import StoredPage
from server.store import PageStore


class GetHandler:
    """Serves one GET: pins the pages asked for that the node holds, has them brought
    into memory, and sends them over the connection's path; pages it lacks are missing
    from the plan, never wrong. On the same host a plan asked for in parts is pinned and
    sent part by part (the client copies one part while the next is planned); every
    part's pins hold until the client's GET_DONE after the last."""

    def __init__(
        self,
        store: PageStore,
        readthrough: ReadThrough,
        metrics: NodeMetrics,
        namespaces: NamespaceCache,
        auth: Authorizer,
    ) -> None:
        self.store = store
        self.readthrough = readthrough
        self.metrics = metrics
        self.namespaces = namespaces
        self.auth = auth

    async def serve(
        self, conn: Connection, req: P.GetRequest, credential: Credential | None
    ) -> None:
        if self.auth.enabled:  # an anonymous node serves any namespace it holds pages of
            self.auth.authorize(credential, await self.namespaces.lookup(req), write=False)
        store = self.store
        held: list[StoredPage] = []  # every part's pinned pages: unpinned once it is done
        runs, count = 0, len(req.hashes)
        step = req.part_pages if conn.plans_in_parts and req.part_pages else count
        try:
            for start in range(0, count, step):
                present, pages = self._pin(req, start, start + step)
                try:
                    present, pages = await self.readthrough.in_memory(present, pages)
                finally:
                    held += pages
                sizes = [p.size for p in pages]
                checksums = np.array([p.checksum for p in pages], dtype=np.uint64)
                runs += await conn.send_pages(
                    req, present, pages, sizes, checksums, more=start + step < count
                )
        except BaseException:
            await conn.close()  # no send may still read from slots that are unpinned next
            raise
        finally:
            for page in held:
                store.unpin(page)
        if req.probe:
            return
        self.metrics.messages.labels("out").inc(runs)
        self.metrics.gets.inc(len(held))
        self.metrics.get_missing.inc(count - len(held))
        self.metrics.sent_bytes.inc(sum(p.size for p in held))

    async def noted(self, req: P.SlotReads, credential: Credential | None) -> None:
        """A same-host client's word that it copied these pages straight from their
        slots (``SlotReads``), sent while its copies run: each page still held is
        counted as read and marked most recently used, like a get's; the others are
        passed over. A page the client's check then fails (it moved since the index
        recorded its slot) is asked for again with a GET and counted twice. Nothing is
        sent back."""
        if self.auth.enabled:
            self.auth.authorize(credential, await self.namespaces.lookup(req), write=False)
        raw, namespace, nbytes, count = req.hashes.tobytes(), req.namespace, 0, 0
        mark = self.store.mark_read
        for at in range(0, len(raw), HASH_BYTES):
            page = mark((namespace, raw[at : at + HASH_BYTES]))
            if page is not None:
                count += 1
                nbytes += page.size
        self.metrics.slot_reads.inc(count)
        self.metrics.gets.inc(count)
        self.metrics.sent_bytes.inc(nbytes)

    def _pin(self, req: P.GetRequest, start: int, end: int) -> tuple[list[int], list[StoredPage]]:
        """Pin the pages of request positions ``start`` to ``end`` that the node holds:
        their positions and pages."""
        present: list[int] = []
        pages: list[StoredPage] = []
        pin, namespace = self.store.pin_for_read, req.namespace
        raw = req.hashes[start:end].tobytes()  # sliced per page: cheaper than row by row
        for i, at in enumerate(range(0, len(raw), HASH_BYTES), start):
            page = pin((namespace, raw[at : at + HASH_BYTES]))
            if page is not None:
                present.append(i)
                pages.append(page)
        return present, pages
