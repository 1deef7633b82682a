"""Serving a PUT: plan, receive, verify, commit (docs/protocol.md)."""

from __future__ import annotations

import asyncio
import logging

from kvstore.errors import IndexScriptError, RemoteFault
from kvstore.index import AsyncPageIndex
from kvstore.pages.checksum import checksums
from kvstore.pages.namespace import Namespace
from kvstore.security.credentials import Credential
from kvstore.wire import protocol as P
from kvstore.wire import shm
from server.dataplane.auth import Authorizer
from server.dataplane.batch import PutBatch
from server.dataplane.connection import Connection
from server.dataplane.errors import Broken
from server.dataplane.namespaces import NamespaceCache
from server.eviction import Evictor
from server.identity import NodeIdentity
from server.metrics import NodeMetrics
from server.page import PageState, commit_entry
from server.store import PageStore
from server.tier import Tier

log = logging.getLogger(__name__)

# Seconds every put may take beyond its size at min_put_rate (connection jitter, the
# client hashing its pages before it sends the checksums).
PUT_GRACE = 2.0


class PutHandler:
    """Serves one PUT: claims the offered pages the node lacks, gives them slots, has
    the client send them, verifies each, and commits the good ones to the index; they
    become ready only once the index has them."""

    def __init__(
        self,
        store: PageStore,
        index: AsyncPageIndex,
        evictor: Evictor,
        tier: Tier,
        metrics: NodeMetrics,
        identity: NodeIdentity,
        namespaces: NamespaceCache,
        auth: Authorizer,
        *,
        put_bytes: int,
        timeout: float,
        min_put_rate: float,
    ) -> None:
        self.store = store
        self.index = index
        self.evictor = evictor
        self.tier = tier
        self.metrics = metrics
        self.identity = identity
        self.namespaces = namespaces
        self.auth = auth
        self.put_bytes = put_bytes  # page bytes one put may reserve
        self.timeout = timeout
        self.min_put_rate = min_put_rate

    async def serve(
        self, conn: Connection, req: P.PutRequest, credential: Credential | None
    ) -> None:
        ns = await self.namespaces.lookup(req)
        self.auth.authorize(credential, ns, write=True)
        batch = self._sort_offered(req, ns.tenant)
        try:
            await self._assign_slots(batch)
            await conn.send_put_plan(batch)
            limit = self._deadline(batch)
            try:
                async with asyncio.timeout(limit):
                    await self._receive(conn, batch)
            except TimeoutError:
                raise Broken(
                    f"a put of {sum(p.size for p in batch.pages)} bytes did not arrive within {limit:.1f} s: "
                    "its slots are released"
                ) from None
            await self._commit(batch, ns)
        finally:
            for page in batch.pages:
                if page not in batch.committed:
                    self.store.abort_put(page)
        self.metrics.messages.labels("in").inc(len(batch.runs))
        self.metrics.puts.inc(len(batch.committed))
        self.metrics.refused.inc(len(batch.refused))
        self.metrics.put_skipped.inc(len(batch.present))
        self.metrics.corrupt.inc(len(batch.corrupt))
        self.metrics.received_bytes.inc(sum(p.size for p in batch.pages))
        await conn.send(P.PutResult(stored=batch.stored, corrupt=batch.corrupt))

    def _sort_offered(self, req: P.PutRequest, owner: str) -> PutBatch:
        """Sort offered pages into present, refused and wanted, claiming the wanted ones.

        Runs without an await, so no other request can claim a key between the check
        and the claim. A page another PUT is receiving right now counts as present:
        that PUT stores it (or the page is a miss later, never wrong bytes)."""
        batch = PutBatch(req)
        slab = self.store.allocator.slab_size
        budget = self.put_bytes  # past it, pages are refused (one request cannot flush a node)
        anchors, positions = req.anchors, req.ints("positions")
        # the token ids of each page's block, when the client sent them (events carry them)
        per_page = len(req.token_ids) // len(req.hashes)
        tokens = req.token_ids.tobytes() if per_page else b""
        width = 4 * per_page
        for i, (h, size) in enumerate(zip(req.hashes, req.ints("sizes"))):
            key = (req.namespace, h.tobytes())
            current = self.store.find_page(key)
            if current is not None:
                # a page being evicted or cleared leaves the index: storing it "again" here
                # would leave it out of the index, so the writer hears refused
                gone = current.state is PageState.EVICTING or current.clearing
                (batch.refused if gone else batch.present).append(i)
            elif size > slab or size > budget:
                batch.refused.append(i)
            else:
                budget -= size
                batch.wanted.append(i)
                page = self.store.claim(
                    key, size, owner=owner, anchor=anchors[i].tobytes(), position=positions[i]
                )
                page.tokens = tokens[i * width : (i + 1) * width]
                batch.pages.append(page)
        return batch

    async def _assign_slots(self, batch: PutBatch) -> None:
        """Slots for the claimed pages; pages that got none are released and refused."""
        if batch.pages:
            await self.evictor.allocate(batch.pages)
        kept = [(i, p) for i, p in zip(batch.wanted, batch.pages) if p.offset is not None]
        for i, page in zip(batch.wanted, batch.pages):
            if page.offset is None:
                self.store.abort_put(page)
                batch.refused.append(i)
        batch.wanted, batch.pages = [i for i, _ in kept], [p for _, p in kept]

    def _deadline(self, batch: PutBatch) -> float:
        """Seconds a put's checksums and payload may take once its slots are reserved:
        ``PUT_GRACE`` plus its bytes at ``min_put_rate``, at most the transfer timeout. A
        client that stalls after the plan holds the slots only that long (with the
        transfer timeout alone, four stalled puts held a whole pool for 30 s)."""
        if self.min_put_rate <= 0:
            return self.timeout
        return min(self.timeout, PUT_GRACE + sum(p.size for p in batch.pages) / self.min_put_rate)

    async def _receive(self, conn: Connection, batch: PutBatch) -> None:
        """The checksums, then the pages as the path lands them in their slots, each
        page verified."""
        try:
            sums, fds = await conn.expect(P.PutChecksums, "put checksums")
            shm.close_fds(fds)
            await conn.plan_delivered(batch)
            if len(sums.checksums) != len(batch.pages):
                raise Broken(f"{len(sums.checksums)} checksums for {len(batch.pages)} wanted pages")
            for page, checksum in zip(batch.pages, sums.ints("checksums")):
                page.checksum = checksum
            async for start, end in conn.arrived(batch):
                self._verify(batch, start, end)
        except BaseException:  # a deadline's cancellation too
            await conn.close()  # no late writes into slots that are about to be reused
            raise

    def _verify(self, batch: PutBatch, start: int, end: int) -> None:
        """Check wanted pages ``start`` to ``end`` against the writer's checksums (on two
        threads: nothing else runs on the node's loop meanwhile but UCX, in its own)."""
        pages = batch.pages[start:end]
        for k, page, digest in zip(
            range(start, end), pages, checksums([self.store.view(p) for p in pages])
        ):
            if digest == page.checksum:
                batch.good.append(page)
            else:
                batch.corrupt.append(batch.wanted[k])

    async def _commit(self, batch: PutBatch, ns: Namespace) -> None:
        """Publish the verified pages; they become ready only once the index has them."""
        good = batch.good
        if not good:
            return
        entries = [commit_entry(p) for p in good]
        try:
            written = await self.index.commit(
                ns, self.identity.number, self.identity.incarnation, entries
            )
        except RemoteFault as exc:
            log.warning("commit failed, dropping %d pages: %s", len(good), exc)
            return
        except IndexScriptError as exc:
            self.metrics.errors.labels("index_script").inc()
            log.error("commit rejected by the index, dropping %d pages: %s", len(good), exc)
            return
        for page, ok in zip(good, written):
            if ok:  # else its index shard failed: the page stays out of the table
                self.store.finish_put(page)
                batch.committed.add(page)
        self.tier.committed([p for p in good if p in batch.committed])
