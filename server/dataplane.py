"""Serving PUT and GET requests over UCX (the protocol is in docs/protocol.md).

One coroutine per client endpoint reads control frames and handles one request at
a time. Payloads are received straight into pool slots and sent straight from them.
A malformed frame body gets an ERROR reply; a bad preamble or a broken transfer
closes that endpoint only."""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass, field
from typing import Any

from kvstore import protocol as P
from kvstore.checksum import page_checksum
from kvstore.errors import IndexScriptError, ProtocolError, RemoteFault
from kvstore.index import AsyncPageIndex, CommitEntry
from kvstore.namespace import Namespace
from kvstore.transport import Channel, with_timeout
from server.eviction import Evictor, NodeIdentity
from server.metrics import NodeMetrics
from server.store import PageState, PageStore, StoredPage

log = logging.getLogger(__name__)


class _Broken(Exception):
    """The endpoint can no longer be trusted to be in step; close it."""


class _Refused(Exception):
    """The request cannot be served; answered with an ERROR frame, endpoint kept."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class PutBatch:
    """One PUT request as it moves through plan, receive and commit.

    ``pages`` are the slots this request claimed (parallel to ``wanted``); whatever
    is not in ``committed`` when the request ends is released."""

    req: P.PutRequest
    present: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    wanted: list[int] = field(default_factory=list)
    pages: list[StoredPage] = field(default_factory=list)
    runs: list[int] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    committed: set[StoredPage] = field(default_factory=set)

    @property
    def stored(self) -> list[int]:
        return [i for i, p in zip(self.wanted, self.pages) if p in self.committed]


class DataPlane:
    def __init__(self, store: PageStore, index: AsyncPageIndex, evictor: Evictor, metrics: NodeMetrics, identity: NodeIdentity, *, token: str, timeout: float, node_ttl_ms: int) -> None:
        self.store = store
        self.index = index
        self.evictor = evictor
        self.metrics = metrics
        self.identity = identity
        self.token = token
        self.timeout = timeout
        self.node_ttl_ms = node_ttl_ms
        self.namespaces: dict[str, Namespace] = {}  # learnt from the index, re-published after an index loss
        self.closing = False
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def serve(self, endpoint: Any) -> None:
        """Listener callback: serve one client endpoint until it goes away."""
        ep = Channel(endpoint)
        try:
            while True:
                try:
                    raw = await ep.recv_frame()
                except ProtocolError as exc:  # a bad preamble: the stream is out of step
                    self.metrics.errors.labels("protocol").inc()
                    await self._reply_error(ep, "protocol", str(exc))
                    return
                except Exception:  # noqa: BLE001 - any receive failure means the peer is gone
                    return
                if self.closing:
                    await self._reply_error(ep, "shutting_down", "node is shutting down")
                    return
                self.active += 1
                self.idle.clear()
                try:
                    await self._dispatch(ep, raw)
                except _Broken as exc:
                    self.metrics.errors.labels("transfer").inc()
                    log.info("closing endpoint after a broken transfer: %s", exc)
                    return
                finally:
                    self.active -= 1
                    if self.active == 0:
                        self.idle.set()
        finally:
            await ep.close()

    async def _dispatch(self, ep: Channel, raw: bytes) -> None:
        try:
            frame = P.decode(raw)
            if not isinstance(frame, (P.PutRequest, P.GetRequest)):
                raise ProtocolError(f"a client may not send {type(frame).__name__}")
            if not hmac.compare_digest(frame.token.encode(), self.token.encode()):
                self.metrics.errors.labels("auth").inc()
                raise _Refused("unauthorized", "data-plane token does not match")
            if isinstance(frame, P.PutRequest):
                with self.metrics.latency.labels("put").time():
                    await self._put(ep, frame)
            else:
                with self.metrics.latency.labels("get").time():
                    await self._get(ep, frame)
        except ProtocolError as exc:
            self.metrics.errors.labels("protocol").inc()
            await self._reply_error(ep, "protocol", str(exc))
        except _Refused as exc:
            await self._reply_error(ep, exc.code, str(exc))

    async def _send(self, ep: Channel, frame: Any) -> None:
        try:
            await with_timeout(ep.send_frame(frame), self.timeout, "control reply")
        except Exception as exc:  # noqa: BLE001
            raise _Broken(f"cannot reply: {exc}") from exc

    async def _reply_error(self, ep: Channel, code: str, message: str) -> None:
        try:
            await self._send(ep, P.ErrorFrame(code=code, message=message))
        except _Broken:
            pass

    async def _namespace(self, digest: str) -> Namespace:
        """The namespace behind a digest, read from the index once and cached."""
        ns = self.namespaces.get(digest)
        if ns is None:
            try:
                ns = await self.index.namespace(digest)
            except RemoteFault as exc:
                raise _Refused("index_unavailable", f"cannot read namespace {digest} from the index: {exc}") from exc
            if ns is None or ns.digest_hex != digest:
                raise _Refused("unknown_namespace", f"namespace {digest} is not registered in the index")
            self.namespaces[digest] = ns
        return ns

    # ---- PUT: plan, receive, commit ----------------------------------------------

    async def _put(self, ep: Channel, req: P.PutRequest) -> None:
        await self._namespace(req.namespace)
        batch = self._plan_put(req)
        try:
            await self._assign_slots(batch)
            await self._send(ep, P.PutPlan(wanted=batch.wanted, runs=batch.runs, present=batch.present, refused=sorted(batch.refused)))
            try:
                await self._move_runs(ep.recv, batch.pages, batch.runs, "page receive")
            except BaseException:
                await ep.close()  # no late writes into slots that are about to be reused
                raise
            await self._commit(batch)
        finally:
            for page in batch.pages:
                if page not in batch.committed:
                    self.store.abort_put(page)
        self.metrics.messages.labels("in").inc(len(batch.runs))
        self.metrics.puts.inc(len(batch.committed))
        self.metrics.refused.inc(len(batch.refused))
        self.metrics.put_skipped.inc(len(batch.present))
        self.metrics.corrupt.inc(len(batch.corrupt))
        self.metrics.bytes_in.inc(sum(p.size for p in batch.pages))
        await self._send(ep, P.PutResult(stored=batch.stored, corrupt=batch.corrupt))

    def _plan_put(self, req: P.PutRequest) -> PutBatch:
        """Sort offered pages into present, refused and wanted, claiming the wanted ones.

        Runs without an await, so no other request can claim a key between the check
        and the claim. A page another PUT is receiving right now counts as present:
        that PUT stores it (or the page is a miss later, never wrong bytes)."""
        batch = PutBatch(req)
        for i, offered in enumerate(req.pages):
            key = (req.namespace, bytes.fromhex(offered.hash))
            current = self.store.find(key)
            if current is not None:
                (batch.refused if current.state is PageState.EVICTING else batch.present).append(i)
            elif offered.size > self.store.allocator.slab_size:
                batch.refused.append(i)
            else:
                batch.wanted.append(i)
                batch.pages.append(self.store.claim(key, offered.size, offered.checksum))
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
        joinable = _joinable([batch.req.pages[i].join for i in batch.wanted], batch.wanted, [p.size for p in batch.pages])
        batch.runs = P.plan_runs([p.offset for p in batch.pages], [p.size for p in batch.pages], joinable, P.DEFAULT_MAX_RUN_BYTES)

    async def _commit(self, batch: PutBatch) -> None:
        """Verify each received page against the writer's checksum and publish the good
        ones; they become ready only once the index has them."""
        good: list[StoredPage] = []
        for i, page in zip(batch.wanted, batch.pages):
            if page_checksum(self.store.view(page)) == page.checksum:
                good.append(page)
            else:
                batch.corrupt.append(i)
        if not good:
            return
        entries = [CommitEntry(p.key[1], p.offset, p.size, p.checksum) for p in good]
        try:
            await self.index.commit(batch.req.namespace, self.identity.node_id, self.identity.incarnation, entries, self.node_ttl_ms)
        except RemoteFault as exc:
            log.warning("commit failed, dropping %d pages: %s", len(good), exc)
            return
        except IndexScriptError as exc:
            self.metrics.errors.labels("index_script").inc()
            log.error("commit rejected by the index, dropping %d pages: %s", len(good), exc)
            return
        for page in good:
            self.store.finish_put(page)
            batch.committed.add(page)

    async def _move_runs(self, op: Any, pages: list[StoredPage], runs: list[int], what: str) -> None:
        """Move each run of pages as one message straight into (``ep.recv``) or out of
        (``ep.send``) their pool slots; any failure breaks the endpoint."""
        pos = 0
        for run in runs:
            group = pages[pos : pos + run]
            pos += run
            view = self.store.pool.view(group[0].offset, group[-1].offset + group[-1].size - group[0].offset)
            try:
                await with_timeout(op(view, P.DATA_TAG), self.timeout, what)
            except Exception as exc:  # noqa: BLE001 - UCX errors, timeouts, cancellation by a dead peer
                raise _Broken(f"{what} of {run} pages failed: {exc}") from exc

    # ---- GET -------------------------------------------------------------------------

    async def _get(self, ep: Channel, req: P.GetRequest) -> None:
        store = self.store
        pages: list[StoredPage] = []
        try:
            present = []
            for i, p in enumerate(req.pages):
                page = store.pin_for_read((req.namespace, bytes.fromhex(p.hash)))
                if page is not None:
                    present.append(i)
                    pages.append(page)
            joinable = _joinable([req.pages[i].join for i in present], present, [p.size for p in pages])
            runs = P.plan_runs([p.offset for p in pages], [p.size for p in pages], joinable, req.max_run_bytes)
            plan = P.GetPlan(present=present, sizes=[p.size for p in pages], checksums=[p.checksum for p in pages], runs=runs)
            await self._send(ep, plan)
            await self._move_runs(ep.send, pages, runs, "page send")
        except BaseException:
            await ep.close()  # no send may still read from slots that are unpinned next
            raise
        finally:
            for page in pages:
                store.unpin(page)
        self.metrics.messages.labels("out").inc(len(runs))
        self.metrics.gets.inc(len(pages))
        self.metrics.get_missing.inc(len(req.pages) - len(pages))
        self.metrics.bytes_out.inc(sum(p.size for p in pages))


def _joinable(flags: list[bool], indexes: list[int], sizes: list[int]) -> list[bool]:
    """The client's join flags, restricted to pages whose request predecessor is also
    in the run (a skipped page in between breaks adjacency in the client's memory),
    unless both pages are small enough to be packed anyway."""
    out = []
    for k, (flag, i) in enumerate(zip(flags, indexes)):
        small = k > 0 and sizes[k] < P.PACK_BELOW and sizes[k - 1] < P.PACK_BELOW
        out.append(flag and k > 0 and (indexes[k - 1] == i - 1 or small))
    return out
