"""Serving client connections: admission, then one request at a time (docs/protocol.md).

One coroutine per connection reads control frames and hands each request to the PUT
or GET handler (server/dataplane/put.py, get.py). A malformed frame body gets an
ERROR reply; a bad preamble or a broken transfer closes that connection only.

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
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ProtocolError
from kvstore.index import AsyncPageIndex
from kvstore.security.credentials import CredentialFile
from kvstore.settings.config import DEFAULT_MAX_REQUEST_PAGES
from kvstore.wire import protocol as P
from kvstore.wire import shm
from kvstore.wire.transport import Channel
from server.dataplane.auth import Authorizer
from server.dataplane.connection import Connection
from server.dataplane.errors import Broken, Refused, Unauthorized
from server.dataplane.get import GetHandler
from server.dataplane.namespaces import NamespaceCache
from server.dataplane.put import PutHandler
from server.dataplane.readthrough import ReadThrough
from server.dataplane.same_host import ShmConnection
from server.dataplane.ucx import UcxConnection
from server.eviction import Evictor
from server.identity import NodeIdentity
from server.limits import RateLimitedLog
from server.metrics import NodeMetrics
from server.store import PageStore
from server.tier import Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLimits:
    """What one request, and one connection, may ask of a node. A connection carries
    one request at a time, so ``put_bytes`` also bounds the bytes in flight per
    connection. ``connections`` bounds the open connections of both paths together;
    ``frame_seconds`` is how long a new connection may take to send its first request,
    and any frame to arrive whole once it started."""

    pages: int = DEFAULT_MAX_REQUEST_PAGES  # --max-request-pages
    put_bytes: int = 1 << 62
    connections: int = 1 << 30
    frame_seconds: float = P.FRAME_REST_TIMEOUT


class _Verdict(enum.Enum):
    """What ``_dispatch`` learnt of a request's credential."""

    ADMITTED = "admitted"  # accepted: the connection may idle between requests from now on
    UNAUTHORIZED = "unauthorized"  # answered ``unauthorized``: the connection is closed
    UNCHECKED = "unchecked"  # refused before the credential was looked at


class DataPlane:
    """Admits client connections (within the connection budget; a credential before
    one may idle) and serves each one's requests in turn, handing each to the PUT or
    GET handler."""

    def __init__(
        self,
        store: PageStore,
        index: AsyncPageIndex,
        evictor: Evictor,
        tier: Tier,
        metrics: NodeMetrics,
        identity: NodeIdentity,
        namespaces: NamespaceCache,
        *,
        credentials: CredentialFile,
        timeout: float,
        min_put_rate: float = 0,
        limits: RequestLimits = RequestLimits(),
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.limits = limits
        self.timeout = timeout
        self.auth = Authorizer(credentials, metrics)
        self.put = PutHandler(
            store,
            index,
            evictor,
            tier,
            metrics,
            identity,
            namespaces,
            self.auth,
            put_bytes=limits.put_bytes,
            timeout=timeout,
            min_put_rate=min_put_rate,
        )
        self.get = GetHandler(
            store, ReadThrough(store, evictor, tier, metrics), metrics, namespaces, self.auth
        )
        self.closing = False
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.connections = {"ucx": 0, "shm": 0}  # open, by path
        self.peer_log = RateLimitedLog(log)  # what remote peers cause, at most a line per interval

    async def serve(self, endpoint: Any) -> None:
        """UCX listener callback: serve one client endpoint until it goes away."""
        await self._serve(
            UcxConnection(
                Channel(endpoint), self.store.pool, self.limits.frame_seconds, self.timeout
            )
        )

    async def serve_unix(self, sock: socket.socket) -> None:
        """Serve one same-host client on an accepted Unix socket until it goes away."""
        channel = shm.UnixChannel(sock, accept_fds=False)
        await self._serve(
            ShmConnection(channel, self.store, self.limits.frame_seconds, self.timeout)
        )

    async def _serve(self, conn: Connection) -> None:
        """Serve one connection: admitted within the connection budget, then one request
        at a time until the peer goes, breaks the stream, or is refused as unauthorized."""
        if sum(self.connections.values()) >= self.limits.connections:
            self.metrics.connections_refused.labels("budget").inc()
            self.peer_log(
                "refusing %s connections: %d are open, the budget (--max-connections)",
                conn.path,
                self.limits.connections,
            )
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
                    kind = (
                        "descriptors"
                        if isinstance(exc, shm.DescriptorsRefusedError)
                        else "protocol"
                    )
                    self.metrics.errors.labels(kind).inc()
                    self.peer_log("closing a %s connection: %s", conn.path, exc)
                    await conn.reply_error(P.RefusalCode.PROTOCOL, str(exc))
                    await conn.linger()
                    return
                except TimeoutError:
                    self.metrics.connections_refused.labels("idle").inc()
                    self.peer_log(
                        "closing a %s connection that sent no request within %.1f s",
                        conn.path,
                        self.limits.frame_seconds,
                    )
                    return
                except Exception:
                    return
                shm.close_fds(fds)  # a request frame carries none (and a node's channel takes none)
                if self.closing:  # a notice is never answered, not even now (``_noted``)
                    if not _is_notice(raw):
                        await conn.reply_error(P.RefusalCode.SHUTTING_DOWN, "node is shutting down")
                        await conn.linger()
                    return
                self.active += 1
                self.idle.clear()
                try:
                    verdict = await self._dispatch(conn, raw)
                except Broken as exc:
                    self.metrics.errors.labels("transfer").inc()
                    self.peer_log(
                        "closing a %s connection after a broken transfer: %s", conn.path, exc
                    )
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

    async def _dispatch(self, conn: Connection, raw: bytes) -> _Verdict:
        """Decode one request, check its credential and size, and hand it to its
        handler; says what was learnt of its credential."""
        try:
            frame = P.decode(raw)
            if isinstance(frame, P.SlotReads):
                return await self._noted(conn, frame)
            if not isinstance(frame, (P.PutRequest, P.GetRequest)):
                raise ProtocolError(f"a request may not start with {type(frame).__name__}")
            credential = self.auth.identify(frame.token)
            if len(frame.hashes) > self.limits.pages:
                self.metrics.errors.labels("too_large").inc()
                raise Refused(
                    P.RefusalCode.TOO_LARGE,
                    f"a request may name at most {self.limits.pages} pages (--max-request-pages), "
                    f"this one names {len(frame.hashes)}",
                )
            op = "put" if isinstance(frame, P.PutRequest) else "get"
            self.metrics.requests.labels(op, conn.path).inc()
            with self.metrics.latency.labels(op).time():
                if isinstance(frame, P.PutRequest):
                    await self.put.serve(conn, frame, credential)
                else:
                    await self.get.serve(conn, frame, credential)
        except Unauthorized as exc:
            await conn.reply_error(P.RefusalCode.UNAUTHORIZED, str(exc))
            return _Verdict.UNAUTHORIZED
        except ProtocolError as exc:
            self.metrics.errors.labels("protocol").inc()
            await conn.reply_error(P.RefusalCode.PROTOCOL, str(exc))
            return _Verdict.UNCHECKED
        except Refused as exc:
            await conn.reply_error(exc.code, str(exc))
        return _Verdict.ADMITTED

    async def _noted(self, conn: Connection, frame: P.SlotReads) -> _Verdict:
        """A same-host client's notice of pages it copied straight from their slots:
        never answered (the client reads no reply, and its next request would take an
        ERROR as its own). A token that matches no credential closes the connection;
        any other refusal drops the notice (it only counts reads and orders eviction)."""
        try:
            credential = self.auth.identify(frame.token)
            if len(frame.hashes) > self.limits.pages:
                raise Refused(P.RefusalCode.TOO_LARGE, "slot-read notice too large")
            self.metrics.requests.labels("slot_reads", conn.path).inc()
            await self.get.noted(frame, credential)
        except Unauthorized:
            return _Verdict.UNAUTHORIZED
        except (Refused, ProtocolError) as exc:
            self.metrics.errors.labels("slot_reads").inc()  # dropped notices, counted
            self.peer_log("dropping a slot-read notice: %s", exc)
            return _Verdict.UNCHECKED
        return _Verdict.ADMITTED


def _is_notice(raw: bytes) -> bool:
    """Whether a frame's preamble names a SLOT_READS notice."""
    try:
        return P.PREAMBLE.unpack_from(raw)[2] == P.FrameType.SLOT_READS
    except Exception:
        return False
