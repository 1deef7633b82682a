"""Serving a GET: pin, bring into memory, send (docs/protocol.md)."""

from __future__ import annotations

import numpy as np

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
    from the plan, never wrong."""

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
        pages: list[StoredPage] = []
        runs = 0
        try:
            present = []
            for i, h in enumerate(req.hashes):
                page = store.pin_for_read((req.namespace, h.tobytes()))
                if page is not None:
                    present.append(i)
                    pages.append(page)
            present, pages = await self.readthrough.in_memory(present, pages)
            sizes = [p.size for p in pages]
            checksums = np.array([p.checksum for p in pages], dtype=np.uint64)
            runs = await conn.send_pages(req, present, pages, sizes, checksums)
        except BaseException:
            await conn.close()  # no send may still read from slots that are unpinned next
            raise
        finally:
            for page in pages:
                store.unpin(page)
        if req.probe:
            return
        self.metrics.messages.labels("out").inc(runs)
        self.metrics.gets.inc(len(pages))
        self.metrics.get_missing.inc(len(req.hashes) - len(pages))
        self.metrics.sent_bytes.inc(sum(p.size for p in pages))
