"""Serving PUT and GET requests over UCX (the protocol is in docs/protocol.md).

One coroutine per client endpoint reads control frames and handles one request at
a time. Payloads are received straight into pool slots and sent straight from them.
A malformed frame gets an ERROR reply; a broken transfer closes that endpoint only."""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from kvstore import protocol as P
from kvstore.checksum import page_checksum
from kvstore.errors import KVStoreError, ProtocolError
from kvstore.index import AsyncPageIndex, CommitEntry
from kvstore.transport import with_timeout
from server.eviction import Evictor, NodeIdentity
from server.metrics import NodeMetrics
from server.store import PageStore, StoredPage

log = logging.getLogger(__name__)


class _Broken(Exception):
    """The endpoint can no longer be trusted to be in step; close it."""


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
        self.closing = False
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def serve(self, ep: Any) -> None:
        """Listener callback: serve one client endpoint until it goes away."""
        try:
            while True:
                try:
                    raw = await ep.am_recv()
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
            await self._close(ep)

    async def _dispatch(self, ep: Any, raw: Any) -> None:
        try:
            frame = P.decode(raw)
            if not isinstance(frame, (P.PutRequest, P.GetRequest)):
                raise ProtocolError(f"a client may not send {type(frame).__name__}")
            if not hmac.compare_digest(frame.token.encode(), self.token.encode()):
                self.metrics.errors.labels("auth").inc()
                await self._reply_error(ep, "unauthorized", "data-plane token does not match")
                return
        except ProtocolError as exc:
            self.metrics.errors.labels("protocol").inc()
            await self._reply_error(ep, "protocol", str(exc))
            return
        if isinstance(frame, P.PutRequest):
            with self.metrics.latency.labels("put").time():
                await self._put(ep, frame)
        else:
            with self.metrics.latency.labels("get").time():
                await self._get(ep, frame)

    async def _send(self, ep: Any, frame: Any) -> None:
        try:
            await with_timeout(ep.am_send(P.encode(frame)), self.timeout, "control reply")
        except Exception as exc:  # noqa: BLE001
            raise _Broken(f"cannot reply: {exc}") from exc

    async def _reply_error(self, ep: Any, code: str, message: str) -> None:
        try:
            await self._send(ep, P.ErrorFrame(code=code, message=message))
        except _Broken:
            pass

    async def _put(self, ep: Any, req: P.PutRequest) -> None:
        ns, store = req.namespace, self.store
        present, refused, candidates = [], [], []
        seen: set[bytes] = set()
        for i, page in enumerate(req.pages):
            h = bytes.fromhex(page.hash)
            if store.find((ns, h)) is not None or h in seen:
                present.append(i)
            elif page.size > store.allocator.slab_size:
                refused.append(i)
            else:
                seen.add(h)
                candidates.append(i)
        slots: list[StoredPage | None] = []
        if candidates:
            hashes = [bytes.fromhex(req.pages[i].hash) for i in candidates]
            try:
                await self.index.reserve(ns, self.identity.node_id, self.identity.epoch, hashes)
                items = [((ns, h), req.pages[i].size, req.pages[i].checksum) for i, h in zip(candidates, hashes)]
                slots = await self.evictor.allocate(items)
            except KVStoreError as exc:
                log.warning("put refused, index unavailable: %s", exc)
                slots = [None] * len(candidates)
        wanted = [i for i, s in zip(candidates, slots) if s is not None]
        pages = [s for s in slots if s is not None]
        refused += [i for i, s in zip(candidates, slots) if s is None]
        self.metrics.refused.inc(len(refused))
        self.metrics.put_skipped.inc(len(present))
        joinable = _joinable([req.pages[i].join for i in wanted], wanted, [p.size for p in pages])
        runs = P.plan_runs([p.offset for p in pages], [p.size for p in pages], joinable, P.DEFAULT_MAX_RUN_BYTES)
        try:
            await self._send(ep, P.PutPlan(wanted=wanted, runs=runs, present=present, refused=sorted(refused)))
            await self._move_runs(ep.recv, pages, runs, "page receive")
        except BaseException:
            await self._close(ep)  # no late writes into slots that are about to be reused
            for page in pages:
                store.abort_put(page)
            raise
        good = [p for p in pages if page_checksum(store.view(p)) == p.checksum]
        good_ids = {id(p) for p in good}
        corrupt = [i for i, p in zip(wanted, pages) if id(p) not in good_ids]
        # Pages held already are committed again (a no-op when the index has them): this
        # heals an index that lost entries, e.g. a Redis restarted without persistence.
        held = [p for p in (store.find((ns, bytes.fromhex(req.pages[i].hash))) for i in present) if p is not None and p.ready]
        committed_ids: set[int] = set()
        if good or held:
            entries = [CommitEntry(p.key[1], p.offset, p.size, p.checksum) for p in good + held]
            try:
                await self.index.commit(ns, self.identity.node_id, self.identity.epoch, entries, self.node_ttl_ms)
                committed_ids = good_ids
            except KVStoreError as exc:
                log.warning("commit failed, dropping %d pages: %s", len(good), exc)
        for page in pages:
            (store.finish_put if id(page) in committed_ids else store.abort_put)(page)
        self.metrics.messages.labels("in").inc(len(runs))
        self.metrics.puts.inc(len(committed_ids))
        self.metrics.corrupt.inc(len(corrupt))
        self.metrics.bytes_in.inc(sum(p.size for p in pages))
        self._update_gauges()
        stored = [i for i, p in zip(wanted, pages) if id(p) in committed_ids]
        await self._send(ep, P.PutResult(stored=stored, corrupt=corrupt))

    async def _move_runs(self, op: Any, pages: list[StoredPage], runs: list[int], what: str) -> None:
        """Move each run of pages as one message straight into (``ep.recv``) or out of
        (``ep.send``) their pool slots; any failure breaks the endpoint."""
        pos = 0
        for run in runs:
            group = pages[pos : pos + run]
            pos += run
            view = self.store.pool.view(group[0].offset, group[-1].offset + group[-1].size - group[0].offset)
            try:
                await with_timeout(op(view), self.timeout, what)
            except Exception as exc:  # noqa: BLE001 - UCX errors, timeouts, cancellation by a dead peer
                raise _Broken(f"{what} of {run} pages failed: {exc}") from exc

    async def _get(self, ep: Any, req: P.GetRequest) -> None:
        store = self.store
        pinned = [store.pin_for_read((req.namespace, bytes.fromhex(p.hash))) for p in req.pages]
        present = [i for i, p in enumerate(pinned) if p is not None]
        pages = [p for p in pinned if p is not None]
        try:
            joinable = _joinable([req.pages[i].join for i in present], present, [p.size for p in pages])
            runs = P.plan_runs([p.offset for p in pages], [p.size for p in pages], joinable, req.max_run_bytes)
            plan = P.GetPlan(present=present, sizes=[p.size for p in pages], checksums=[p.checksum for p in pages], runs=runs)
            await self._send(ep, plan)
            await self._move_runs(ep.send, pages, runs, "page send")
        finally:
            for page in pages:
                store.unpin(page)
        self.metrics.messages.labels("out").inc(len(runs))
        self.metrics.gets.inc(len(pages))
        self.metrics.get_missing.inc(len(req.pages) - len(pages))
        self.metrics.bytes_out.inc(sum(p.size for p in pages))

    def _update_gauges(self) -> None:
        self.metrics.used.set(self.store.used_bytes)
        self.metrics.pages.set(self.store.ready_pages)

    @staticmethod
    async def _close(ep: Any) -> None:
        try:
            if not ep.closed:
                ep.abort()
        except Exception:  # noqa: BLE001 - already gone
            pass


def _joinable(flags: list[bool], indexes: list[int], sizes: list[int]) -> list[bool]:
    """The client's join flags, restricted to pages whose request predecessor is also
    in the run (a skipped page in between breaks adjacency in the client's memory),
    unless both pages are small enough to be packed anyway."""
    out = []
    for k, (flag, i) in enumerate(zip(flags, indexes)):
        small = k > 0 and sizes[k] < P.PACK_BELOW and sizes[k - 1] < P.PACK_BELOW
        out.append(flag and k > 0 and (indexes[k - 1] == i - 1 or small))
    return out
