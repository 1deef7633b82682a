"""Serving PUT and GET requests (the protocol is in docs/protocol.md).

Two data paths share one request logic: UCX endpoints (any host; payloads are
received straight into pool slots and sent straight from them) and Unix sockets
for clients on the node's host (kvstore.wire.shm: pages move through shared memory with
one copy). One coroutine per connection reads control frames and handles one
request at a time. A malformed frame body gets an ERROR reply; a bad preamble or a
broken transfer closes that connection only.

What a peer gets before it shows a credential is bounded (docs/security.md): a
connection over the budget is closed at once, its first request must arrive within
the frame timeout, an ``unauthorized`` answer closes it, descriptors sent over the
Unix socket are refused, and whatever a peer causes is logged at most once per
interval."""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.errors import IndexScriptError, ProtocolError, RemoteFault
from kvstore.index import AsyncPageIndex
from kvstore.pages.checksum import checksums
from kvstore.pages.keys import NamespaceKey
from kvstore.pages.namespace import Namespace
from kvstore.security.credentials import Credential, CredentialFile
from kvstore.wire import protocol as P
from kvstore.wire import shm
from kvstore.wire.transport import Channel, started, with_timeout
from server.eviction import Evictor, NodeIdentity
from server.limits import RateLimitedLog
from server.metrics import NodeMetrics
from server.store import PageState, PageStore, StoredPage, commit_entry

log = logging.getLogger(__name__)


class _Broken(Exception):
    """The connection can no longer be trusted to be in step; close it."""


class _Verdict(enum.Enum):
    """What ``_dispatch`` learnt of a request's credential."""

    ADMITTED = "admitted"  # accepted: the connection may idle between requests from now on
    UNAUTHORIZED = "unauthorized"  # answered ``unauthorized``: the connection is closed
    UNCHECKED = "unchecked"  # refused before the credential was looked at


class _Refused(Exception):
    """The request cannot be served; answered with an ERROR frame, connection kept."""

    def __init__(self, code: P.RefusalCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _UcxConn:
    """A client over a UCX endpoint."""

    path = "ucx"

    def __init__(self, channel: Channel, frame_seconds: float) -> None:
        self.channel = channel
        self.frame_seconds = frame_seconds

    async def recv(self, first_timeout: float | None = None) -> tuple[bytes, list[int]]:
        return await self.channel.recv_frame(rest_timeout=self.frame_seconds, first_timeout=first_timeout), []

    async def send(self, frame: Any, fds: list[int] = ()) -> None:
        await self.channel.send_frame(frame)

    async def linger(self) -> None:
        """Before closing after an error reply: wait until the peer closes or sends
        anything, at most ``LINGER`` seconds. ucxx's close is an abort, which drops
        what UCX has not written out yet: measured, a protocol error answered just
        before the abort reached the client in only some of 11 tries."""
        landed = self.channel.post_recv(np.empty(1, dtype=np.uint8), P.CONTROL_TAG)
        await asyncio.wait([landed], timeout=LINGER)

    async def close(self) -> None:
        await self.channel.close()


class _ShmConn:
    """A same-host client over a Unix socket; remembers which slab descriptors it was
    sent (generation, and whether writable)."""

    path = "shm"

    def __init__(self, channel: shm.UnixChannel, frame_seconds: float) -> None:
        self.channel = channel
        self.frame_seconds = frame_seconds
        self.sent: dict[int, tuple[int, bool]] = {}  # slab index -> (generation, writable) the client has

    async def recv(self, first_timeout: float | None = None) -> tuple[bytes, list[int]]:
        return await self.channel.recv_frame(rest_timeout=self.frame_seconds, first_timeout=first_timeout)

    async def send(self, frame: Any, fds: list[int] = ()) -> None:
        await self.channel.send_frame(frame, fds)

    async def linger(self) -> None:
        """Nothing to wait for: what was written to a Unix socket stays readable after close."""

    async def close(self) -> None:
        self.channel.close()


@dataclass(frozen=True)
class RequestLimits:
    """What one request, and one connection, may ask of a node. A connection carries
    one request at a time, so ``put_bytes`` also bounds the bytes in flight per
    connection. ``connections`` bounds the open connections of both paths together;
    ``frame_seconds`` is how long a new connection may take to send its first request,
    and any frame to arrive whole once it started."""

    pages: int = P.MAX_PAGES_PER_REQUEST
    put_bytes: int = 1 << 62
    connections: int = 1 << 30
    frame_seconds: float = P.FRAME_REST_TIMEOUT


# Seconds a connection closed after an error reply waits for the peer (_UcxConn.linger).
LINGER = 1.0
# A same-host client's start probe is also lent (read-only) the slabs its tenant holds
# pages in, the newest first, up to this many bytes of them: the client maps them at
# start instead of in its first get. Measured, a fresh engine's first load of 120 MiB
# (8 slabs of 16 MiB) spent 7-11 ms mapping them; mapping costs the client page tables
# (2 MiB per GiB faulted in), so it stops here and later slabs map on first use.
PROBE_MAP_BYTES = 1 << 30
# Seconds every put may take beyond its size at min_put_rate (connection jitter, the
# client hashing its pages before it sends the checksums).
PUT_GRACE = 2.0


@dataclass
class PutBatch:
    """One PUT request as it moves through plan, receive and commit.

    ``pages`` are the slots this request claimed (parallel to ``wanted``); ``good``
    are those received and verified; whatever is not in ``committed`` when the
    request ends is released."""

    req: P.PutRequest
    present: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    wanted: list[int] = field(default_factory=list)
    pages: list[StoredPage] = field(default_factory=list)
    runs: list[int] = field(default_factory=list)
    good: list[StoredPage] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    committed: set[StoredPage] = field(default_factory=set)

    @property
    def stored(self) -> list[int]:
        return [i for i, p in zip(self.wanted, self.pages) if p in self.committed]


class DataPlane:
    def __init__(self, store: PageStore, index: AsyncPageIndex, evictor: Evictor, metrics: NodeMetrics, identity: NodeIdentity, *,
                 credentials: CredentialFile, timeout: float, min_put_rate: float = 0, limits: RequestLimits = RequestLimits()) -> None:
        self.store = store
        self.min_put_rate = min_put_rate
        self.index = index
        self.evictor = evictor
        self.metrics = metrics
        self.identity = identity
        self.credentials = credentials
        self.limits = limits
        self.timeout = timeout
        self.namespaces: dict[str, Namespace] = {}  # learnt from the index, re-published after an index loss
        self.closing = False
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.connections = {"ucx": 0, "shm": 0}  # open, by path
        self.peer_log = RateLimitedLog(log)  # what remote peers cause, at most a line per interval
        self.tier: Any = None  # the disk tier (server/disk/tier.py), when the node has one

    async def serve(self, endpoint: Any) -> None:
        """UCX listener callback: serve one client endpoint until it goes away."""
        await self._serve(_UcxConn(Channel(endpoint), self.limits.frame_seconds))

    async def serve_unix(self, sock: socket.socket) -> None:
        """Serve one same-host client on an accepted Unix socket until it goes away."""
        await self._serve(_ShmConn(shm.UnixChannel(sock, accept_fds=False), self.limits.frame_seconds))

    async def _serve(self, conn: _UcxConn | _ShmConn) -> None:
        """Serve one connection: admitted within the connection budget, then one request
        at a time until the peer goes, breaks the stream, or is refused as unauthorized."""
        if sum(self.connections.values()) >= self.limits.connections:
            self.metrics.connections_refused.labels("budget").inc()
            self.peer_log("refusing %s connections: %d are open, the budget (--max-connections)", conn.path, self.limits.connections)
            await conn.close()
            return
        self.connections[conn.path] += 1
        try:
            authenticated = False
            while True:
                try:
                    # a client may keep its connection idle between requests, once it showed a credential
                    raw, fds = await conn.recv(None if authenticated else self.limits.frame_seconds)
                except ProtocolError as exc:  # a bad preamble: the stream is out of step
                    kind = "descriptors" if isinstance(exc, shm.DescriptorsRefusedError) else "protocol"
                    self.metrics.errors.labels(kind).inc()
                    self.peer_log("closing a %s connection: %s", conn.path, exc)
                    await self._reply_error(conn, P.RefusalCode.PROTOCOL, str(exc))
                    await conn.linger()
                    return
                except asyncio.TimeoutError:
                    self.metrics.connections_refused.labels("idle").inc()
                    self.peer_log("closing a %s connection that sent no request within %.1f s", conn.path, self.limits.frame_seconds)
                    return
                except Exception:  # noqa: BLE001 - any receive failure means the peer is gone
                    return
                shm.close_fds(fds)  # a request frame carries none (and a node's channel takes none)
                if self.closing:
                    await self._reply_error(conn, P.RefusalCode.SHUTTING_DOWN, "node is shutting down")
                    await conn.linger()
                    return
                self.active += 1
                self.idle.clear()
                try:
                    verdict = await self._dispatch(conn, raw)
                except _Broken as exc:
                    self.metrics.errors.labels("transfer").inc()
                    self.peer_log("closing a %s connection after a broken transfer: %s", conn.path, exc)
                    return
                finally:
                    self.active -= 1
                    if self.active == 0:
                        self.idle.set()
                if verdict is _Verdict.UNAUTHORIZED:
                    self.metrics.connections_refused.labels("unauthorized").inc()
                    await conn.linger()
                    return
                authenticated = authenticated or verdict is _Verdict.ADMITTED
        finally:
            self.connections[conn.path] -= 1
            await conn.close()

    async def _dispatch(self, conn: _UcxConn | _ShmConn, raw: bytes) -> _Verdict:
        """Decode and serve one request; says what was learnt of its credential."""
        try:
            frame = P.decode(raw)
            if not isinstance(frame, (P.PutRequest, P.GetRequest)):
                raise ProtocolError(f"a request may not start with {type(frame).__name__}")
            credential = self.credentials.find(frame.token)
            if credential is None and self.credentials.enabled:
                self.metrics.errors.labels("auth").inc()
                await self._reply_error(conn, P.RefusalCode.UNAUTHORIZED, "the data-plane token matches no credential of this node")
                return _Verdict.UNAUTHORIZED
            if len(frame.hashes) > self.limits.pages:
                self.metrics.errors.labels("too_large").inc()
                raise _Refused(P.RefusalCode.TOO_LARGE, f"a request may name at most {self.limits.pages} pages (--max-request-pages), this one names {len(frame.hashes)}")
            op = "put" if isinstance(frame, P.PutRequest) else "get"
            self.metrics.requests.labels(op, conn.path).inc()
            with self.metrics.latency.labels(op).time():
                await (self._put(conn, frame, credential) if op == "put" else self._get(conn, frame, credential))
        except ProtocolError as exc:
            self.metrics.errors.labels("protocol").inc()
            await self._reply_error(conn, P.RefusalCode.PROTOCOL, str(exc))
            return _Verdict.UNCHECKED
        except _Refused as exc:
            await self._reply_error(conn, exc.code, str(exc))
        return _Verdict.ADMITTED

    def _put_deadline(self, batch: PutBatch) -> float:
        """Seconds a put's checksums and payload may take once its slots are reserved:
        ``PUT_GRACE`` plus its bytes at ``min_put_rate``, at most the transfer timeout. A
        client that stalls after the plan holds the slots only that long (with the
        transfer timeout alone, four stalled puts held a whole pool for 30 s)."""
        if self.min_put_rate <= 0:
            return self.timeout
        return min(self.timeout, PUT_GRACE + sum(p.size for p in batch.pages) / self.min_put_rate)

    async def _receive_put(self, conn: _UcxConn | _ShmConn, batch: PutBatch, plan_sent: list[asyncio.Future]) -> None:
        """The checksums, then the payload (UCX) or the pages the client wrote into its
        slots (shared memory), each page verified. Over UCX the runs' receives are
        posted before anything arrives and the plan's send (``plan_sent``) is awaited
        only then: waiting for its completion first cost about 1 ms per put
        (``Channel.post_send``)."""
        try:
            landing = self._post_runs(conn.channel, batch) if conn.path == "ucx" else []
            sums, fds = await self._expect(conn, P.PutChecksums, "put checksums")
            shm.close_fds(fds)
            if plan_sent:
                try:
                    await with_timeout(asyncio.shield(asyncio.gather(*plan_sent)), self.timeout, "put plan")
                except Exception as exc:  # noqa: BLE001 - UCX errors, timeouts
                    raise _Broken(f"cannot send the put plan: {exc}") from exc
            if len(sums.checksums) != len(batch.pages):
                raise _Broken(f"{len(sums.checksums)} checksums for {len(batch.pages)} wanted pages")
            for page, checksum in zip(batch.pages, sums.ints("checksums")):
                page.checksum = checksum
            if conn.path == "shm":  # the client wrote the pages into their slots
                self._verify(batch, 0, len(batch.pages))
            else:
                await self._verify_runs(batch, landing)
        except BaseException:  # a deadline's cancellation too
            await conn.close()  # no late writes into slots that are about to be reused
            raise

    async def _send(self, conn: _UcxConn | _ShmConn, frame: Any, fds: list[int] = ()) -> None:
        try:
            await with_timeout(conn.send(frame, fds), self.timeout, "control reply")
        except Exception as exc:  # noqa: BLE001
            raise _Broken(f"cannot reply: {exc}") from exc

    async def _expect(self, conn: _UcxConn | _ShmConn, kind: type, what: str) -> tuple[Any, list[int]]:
        """The next frame, which must be ``kind``: anything else (or nothing within the
        timeout) leaves the connection out of step."""
        try:
            raw, fds = await with_timeout(conn.recv(), self.timeout, what)
        except Exception as exc:  # noqa: BLE001
            raise _Broken(f"no {what}: {exc}") from exc
        try:
            frame = P.decode(raw)
        except ProtocolError as exc:
            shm.close_fds(fds)
            raise _Broken(f"bad {what}: {exc}") from exc
        if not isinstance(frame, kind):
            shm.close_fds(fds)
            raise _Broken(f"expected {kind.__name__}, got {type(frame).__name__}")
        return frame, fds

    async def _reply_error(self, conn: _UcxConn | _ShmConn, code: P.RefusalCode, message: str) -> None:
        try:
            await self._send(conn, P.ErrorFrame(code=code, message=message))
        except _Broken:
            pass

    def _authorize(self, credential: Credential | None, ns: Namespace, write: bool) -> None:
        """Refuse a request whose credential does not cover the namespace's tenant. The
        tenant is the one the digest names (read from the index and checked against the
        digest), never a claim of the frame. ``None`` passes only on an anonymous node."""
        if credential is None and not self.credentials.enabled:
            return
        if credential is None or not credential.allows(ns.tenant, write):
            self.metrics.errors.labels("forbidden").inc()
            right = "write" if write else "read"
            raise _Refused(P.RefusalCode.FORBIDDEN, f"credential {credential.name if credential else '-'} may not {right} pages of tenant {ns.tenant}")

    async def _namespace(self, req: P.PutRequest | P.GetRequest) -> Namespace:
        """The namespace behind a request's digest, read from the index once (under the
        tenant the request names) and cached. What the index holds must hash to the
        digest, so the tenant a node acts on is the one the digest names; then the node
        lists it in the registry (clients cannot)."""
        digest = req.namespace
        ns = self.namespaces.get(digest)
        if ns is not None and ns.tenant != req.tenant:  # the same answer whether cached or not
            raise _Refused(P.RefusalCode.UNKNOWN_NAMESPACE, f"namespace {digest} of tenant {req.tenant} is not registered in the index")
        if ns is None:
            key = NamespaceKey(req.tenant, digest)
            try:
                ns = await self.index.namespace(key)
            except RemoteFault as exc:
                raise _Refused(P.RefusalCode.INDEX_UNAVAILABLE, f"cannot read namespace {digest} from the index: {exc}") from exc
            if ns is None or ns.digest_hex != digest or ns.tenant != req.tenant:
                raise _Refused(P.RefusalCode.UNKNOWN_NAMESPACE, f"namespace {digest} of tenant {req.tenant} is not registered in the index")
            try:
                await self.index.announce_namespace(key)
            except RemoteFault as exc:  # only `kvstore stats` misses it; announced again after an index loss
                log.warning("cannot list namespace %s in the registry: %s", key.member, exc)
            self.namespaces[digest] = ns
        return ns

    # ---- PUT: plan, receive, verify, commit -----------------------------------------

    async def _put(self, conn: _UcxConn | _ShmConn, req: P.PutRequest, credential: Credential | None) -> None:
        ns = await self._namespace(req)
        self._authorize(credential, ns, write=True)
        batch = self._sort_offered(req, ns.tenant)
        try:
            await self._assign_slots(batch, ucx=conn.path == "ucx")
            fields = dict(wanted=batch.wanted, runs=batch.runs, present=batch.present, refused=sorted(batch.refused))
            plan_sent: list[asyncio.Future] = []
            if conn.path == "shm":
                await self._lend(conn, P.PutPlan, fields, batch.pages, writable=True)
            else:
                plan_sent = conn.channel.post_frame(P.PutPlan(**fields))
            limit = self._put_deadline(batch)
            try:
                async with asyncio.timeout(limit):
                    await self._receive_put(conn, batch, plan_sent)
            except TimeoutError:
                raise _Broken(f"a put of {sum(p.size for p in batch.pages)} bytes did not arrive within {limit:.1f} s: its slots are released") from None
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
        await self._send(conn, P.PutResult(stored=batch.stored, corrupt=batch.corrupt))

    def _sort_offered(self, req: P.PutRequest, owner: str) -> PutBatch:
        """Sort offered pages into present, refused and wanted, claiming the wanted ones.

        Runs without an await, so no other request can claim a key between the check
        and the claim. A page another PUT is receiving right now counts as present:
        that PUT stores it (or the page is a miss later, never wrong bytes)."""
        batch = PutBatch(req)
        slab = self.store.allocator.slab_size
        budget = self.limits.put_bytes  # past it, pages are refused (one request cannot flush a node)
        anchors, positions = req.anchors, req.ints("positions")
        for i, (h, size) in enumerate(zip(req.hashes, req.ints("sizes"))):
            key = (req.namespace, h.tobytes())
            current = self.store.find(key)
            if current is not None:
                (batch.refused if current.state is PageState.EVICTING else batch.present).append(i)
            elif size > slab or size > budget:
                batch.refused.append(i)
            else:
                budget -= size
                batch.wanted.append(i)
                batch.pages.append(self.store.claim(key, size, owner=owner, anchor=anchors[i].tobytes(), position=positions[i]))
        return batch

    async def _assign_slots(self, batch: PutBatch, ucx: bool) -> None:
        """Slots for the claimed pages; pages that got none are released and refused.
        UCX puts also group the pages into runs (one message each)."""
        if batch.pages:
            await self.evictor.allocate(batch.pages)
        kept = [(i, p) for i, p in zip(batch.wanted, batch.pages) if p.offset is not None]
        for i, page in zip(batch.wanted, batch.pages):
            if page.offset is None:
                self.store.abort_put(page)
                batch.refused.append(i)
        batch.wanted, batch.pages = [i for i, _ in kept], [p for _, p in kept]
        if ucx:
            join = [bool(batch.req.join[i]) for i in batch.wanted]
            batch.runs = P.group_runs([p.offset for p in batch.pages], [p.size for p in batch.pages], join, batch.wanted, P.DEFAULT_MAX_RUN_BYTES)

    def _verify(self, batch: PutBatch, start: int, end: int) -> None:
        """Check wanted pages ``start`` to ``end`` against the writer's checksums (on two
        threads: nothing else runs on the node's loop meanwhile but UCX, in its own)."""
        pages = batch.pages[start:end]
        for k, page, digest in zip(range(start, end), pages, checksums([self.store.view(p) for p in pages])):
            if digest == page.checksum:
                batch.good.append(page)
            else:
                batch.corrupt.append(batch.wanted[k])

    def _post_runs(self, ch: Channel, batch: PutBatch) -> list[tuple[int, int, asyncio.Future]]:
        """Post every run's receive straight into its slots at once (in run order, so
        they match the client's messages in order; posting one after the other landed
        cost a trip through ucxx's threads per run): per run, its first and past-last
        wanted page and the future of its landing."""
        starts = np.cumsum([0] + batch.runs).tolist()
        return [(starts[r], starts[r + 1], self._receive_run(ch, batch.pages, starts, r)) for r in range(len(batch.runs))]

    async def _verify_runs(self, batch: PutBatch, landing: list[tuple[int, int, asyncio.Future]]) -> None:
        """Verify each run once it has landed, while later ones arrive (UCX progresses
        in its own thread); the checksums are in by then."""
        for start, end, landed in landing:
            await landed
            self._verify(batch, start, end)

    async def _commit(self, batch: PutBatch, ns: Namespace) -> None:
        """Publish the verified pages; they become ready only once the index has them."""
        good = batch.good
        if not good:
            return
        entries = [commit_entry(p) for p in good]
        try:
            written = await self.index.commit(ns, self.identity.number, self.identity.incarnation, entries)
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
        if self.tier is not None:
            self.tier.committed([p for p in good if p in batch.committed])

    def _receive_run(self, ch: Channel, pages: list[StoredPage], starts: list[int], r: int) -> asyncio.Future:
        """Post the receive of run ``r`` straight into its pool slots now; the future
        raises ``_Broken`` on any failure."""
        group = pages[starts[r] : starts[r + 1]]
        received = ch.post_recv(self._run_view(group), P.DATA_TAG)

        async def landed() -> None:
            try:
                await with_timeout(asyncio.shield(received), self.timeout, "page receive")
            except Exception as exc:  # noqa: BLE001 - UCX errors, timeouts, cancellation by a dead peer
                raise _Broken(f"page receive of {len(group)} pages failed: {exc}") from exc

        return started(landed())

    def _run_view(self, group: list[StoredPage]) -> Any:
        """The pool bytes of a run: pages that lie back to back in their slots."""
        return self.store.pool.view(group[0].offset, group[-1].offset + group[-1].size - group[0].offset)

    # ---- GET -------------------------------------------------------------------------

    async def _get(self, conn: _UcxConn | _ShmConn, req: P.GetRequest, credential: Credential | None) -> None:
        if self.credentials.enabled:  # an anonymous node serves any namespace it holds pages of
            self._authorize(credential, await self._namespace(req), write=False)
        store = self.store
        pages: list[StoredPage] = []
        runs: list[int] = []
        try:
            present = []
            for i, h in enumerate(req.hashes):
                page = store.pin_for_read((req.namespace, h.tobytes()))
                if page is not None:
                    present.append(i)
                    pages.append(page)
            present, pages = await self._in_memory(present, pages)
            sizes = [p.size for p in pages]
            checksums = np.array([p.checksum for p in pages], dtype=np.uint64)
            if conn.path == "shm":
                also = self.store.allocator.slabs_of(req.tenant, max(1, PROBE_MAP_BYTES // self.store.allocator.slab_size)) if req.probe else None
                await self._lend(conn, P.GetPlan, dict(present=present, sizes=sizes, checksums=checksums), pages, writable=False, also=also)
                await self._expect(conn, P.GetDone, "get done")
            else:
                runs = P.group_runs([p.offset for p in pages], sizes, [bool(req.join[i]) for i in present], present, req.max_run_bytes)
                await self._reply_with_runs(conn.channel, P.GetPlan(present=present, sizes=sizes, checksums=checksums, runs=runs), pages, runs)
        except BaseException:
            await conn.close()  # no send may still read from slots that are unpinned next
            raise
        finally:
            for page in pages:
                store.unpin(page)
        if req.probe:
            return
        self.metrics.messages.labels("out").inc(len(runs))
        self.metrics.gets.inc(len(pages))
        self.metrics.get_missing.inc(len(req.hashes) - len(pages))
        self.metrics.sent_bytes.inc(sum(p.size for p in pages))

    async def _in_memory(self, present: list[int], pages: list[StoredPage]) -> tuple[list[int], list[StoredPage]]:
        """The pinned pages of a get, in memory: those only on disk are read back first
        (server/disk/tier.py); one that could not be is unpinned and reads as missing."""
        needed = [p for p in pages if p.offset is None or p.loading is not None]
        from_disk = 0
        if needed:
            await self.tier.load(needed)
            from_disk = sum(p.offset is not None for p in needed)
            kept = [(i, p) for i, p in zip(present, pages) if p.offset is not None]
            for page in needed:
                if page.offset is None:
                    self.store.unpin(page)
            present, pages = [i for i, _ in kept], [p for _, p in kept]
        self.metrics.hits.labels("disk").inc(from_disk)
        self.metrics.hits.labels("memory").inc(len(pages) - from_disk)
        return present, pages

    async def _reply_with_runs(self, ch: Channel, plan: P.GetPlan, pages: list[StoredPage], runs: list[int]) -> None:
        """Post the plan and every run's message out of the pool at once, then wait for
        all of them: the client posts each run's receive as the plan tells it, and a
        run whose receive is not posted yet waits in UCX (rendezvous) or is buffered
        (small, eager). Awaiting the plan before the payload cost about a millisecond
        per get here (``Channel.post_send``)."""
        starts = np.cumsum([0] + runs).tolist()
        sends = ch.post_frame(plan)
        for r in range(len(runs)):
            sends.append(ch.post_send(self._run_view(pages[starts[r] : starts[r + 1]]), P.DATA_TAG))
        try:
            await with_timeout(asyncio.shield(asyncio.gather(*sends)), self.timeout, "get reply")
        except Exception as exc:  # noqa: BLE001 - UCX errors, timeouts, cancellation by a dead peer
            raise _Broken(f"sending the plan and {len(runs)} runs of {len(pages)} pages failed: {exc}") from exc

    async def _lend(self, conn: _ShmConn, kind: type, fields: dict, pages: list[StoredPage], writable: bool, also: list[int] | None = None) -> None:
        """Same-host plan: where each page's slot lies (slab and offset), with descriptors
        of the slabs the client lacks at their current generation (and of the slabs
        ``also`` names): read-only for a GET, writable for a PUT (the client writes the
        wanted pages into their slots). More descriptors than one frame carries go in
        earlier frames marked ``more``."""
        slab = self.store.allocator.slab_size
        regions = [p.offset // slab for p in pages]
        pool = self.store.pool

        def lacks(r: int) -> bool:
            generation, has_write = conn.sent.get(r, (-1, False))
            return generation != pool.regions[r].generation or (writable and not has_write)

        fresh = sorted({r for r in (*regions, *(also or ())) if lacks(r)})
        # One frame's descriptors are open at a time: a request holds at most
        # MAX_FDS_PER_FRAME of the node's descriptors, however many slabs it touches.
        for start in range(0, max(len(fresh), 1), shm.MAX_FDS_PER_FRAME):
            chunk = fresh[start : start + shm.MAX_FDS_PER_FRAME]
            last = start + shm.MAX_FDS_PER_FRAME >= len(fresh)
            mapped = [[r, pool.regions[r].generation] for r in chunk]
            frame = kind(**fields, regions=regions, offsets=[p.offset % slab for p in pages], mapped=mapped) if last else kind(mapped=mapped, more=True)
            fds: list[int] = []
            try:
                for r in chunk:
                    fds.append(shm.reopen(pool.regions[r].fd, writable))
                await self._send(conn, frame, fds)
            except OSError as exc:  # EMFILE: the client reads a miss, the node keeps serving
                raise _Broken(f"cannot lend slab descriptors: {exc}") from exc
            finally:
                shm.close_fds(fds)
        for r in fresh:
            conn.sent[r] = (pool.regions[r].generation, writable)
