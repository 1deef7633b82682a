"""The storage nodes as one client sees them: the registry (read again in the
background while the client is in use, ``NodeDirectory``), which nodes failed recently
(suspects), and one connection per node (shared memory on this host, UCX elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import numpy as np

from client.log_limit import LogLimit
from client.memory.buffers import Span
from client.memory.device_pages import DeviceCopier
from client.nodes.calls import (
    ClosedBeforeUseError,
    NodeClosedBeforeUseError,
    NodeRefusedError,
    SameHostUnavailableError,
)
from client.nodes.connection import NodeConnection
from client.nodes.placement import rank_nodes
from client.nodes.shm_connection import ShmConnection
from client.stats import ClientStats
from kvstore.errors import RemoteFault, TransportTimeoutError
from kvstore.index import AsyncPageIndex, NodeInfo, PageLocation
from kvstore.pages.keys import NamespaceKey
from kvstore.wire.shm import host_id

log = logging.getLogger(__name__)
# A node that failed is skipped for SUSPECT_FIRST seconds, doubling with every further
# failure up to SUSPECT_MAX, and forgiven on its first success: a node back from a
# stall serves again within about a second, one that stays dead is not hammered.
SUSPECT_FIRST = 0.5
SUSPECT_MAX = 8.0
# The registry is read again every ``node_refresh`` seconds in the background while the
# client was used in the last KEEP_FRESH_S seconds, so no call waits for it (a 16-block
# lookup after a pause paid about 0.3 ms, a quarter of its time, to read the registry in
# its round trip: bench/lookup.py, paused lookups). Idle longer, the client reads nothing
# (it costs no CPU); its next call reads the registry first when the list is then older
# than two refreshes, so no call decides on a list older than that while the registry
# answers: a lookup in the same round trip as its segments (``offered``), other calls
# before theirs. Nodes rarely change, and a node that died meanwhile costs a miss, not
# bytes.
KEEP_FRESH_S = 5.0


class NodeDirectory:
    """One job: the client's view of the nodes (registry, suspects, connections).
    Called on the client's event loop, except ``fresh``, ``offered``, ``cached`` and
    ``last``, which any thread may call (the blocking client's lookups, in the caller's
    thread).
    ``start`` (the client's start, on its loop) begins the background reads; ``ucxx``
    is set by the client's start too."""

    def __init__(
        self,
        index: AsyncPageIndex,
        stats: ClientStats,
        *,
        token: str,
        same_host: bool,
        refresh: float,
        device: DeviceCopier | None = None,
    ) -> None:
        # per-request faults (a node failing each call) repeat at most once a minute
        self.log_limit = LogLimit(log)
        self.index = index
        self.stats = stats
        self.ucxx: Any = None
        # lands gets into device memory (client.memory.device_pages); every connection has it
        self.device = device
        self.same_host = same_host
        self._token = token
        self._refresh = refresh
        self._stale_after = 2 * refresh
        # replaced whole, never mutated: other threads read them without a lock
        self._nodes: list[NodeInfo] = []
        # monotonic time of the read that gave _nodes; None before the first
        self._nodes_at: float | None = None
        self._keep_lock = threading.Lock()  # a newer list is never replaced by an older one
        self._read_failed = False  # the last background read of the registry failed
        self._used_at = time.monotonic()
        self._dormant = False  # the background reads wait for a call (the client was idle)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._reader: asyncio.Task[None] | None = None
        self._conns: dict[str, NodeConnection | ShmConnection] = {}
        self._shm_failed: dict[str, str] = {}  # node id -> incarnation whose Unix socket failed
        self._suspect: dict[str, float] = {}  # node id -> skipped until (monotonic)
        self._strikes: dict[str, int] = {}  # node id -> failures since its last success
        # node id -> why it refused this client's token at start
        self.refused_at_start: dict[str, str] = {}

    def start(self) -> None:
        """Loop thread (client start): begin reading the registry in the background."""
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._reader = self._loop.create_task(self._keep_fresh(), name="kvstore-node-registry")

    async def live(self, include_suspect: bool = False) -> list[NodeInfo]:
        """The registered nodes for a put or a get (``current``); nodes that failed
        recently are left out unless ``include_suspect``."""
        nodes = await self.current()
        now = time.monotonic()
        for node_id in [n for n, until in self._suspect.items() if until < now]:
            del self._suspect[node_id]
        return [n for n in nodes if include_suspect or n.node_id not in self._suspect]

    async def current(self) -> list[NodeInfo]:
        """The registered nodes, suspects included, for one call: the list the
        background reads keep, read first only when it names no node or the client was
        idle long enough for it to be stale (``fresh``, KEEP_FRESH_S)."""
        nodes = self.fresh()
        if nodes is None:
            await self._read()
            self._resume()
            nodes = self._nodes
            if self._read_failed:
                self.stats.index_errors += 1  # the call decides on the last list, however old
        return nodes

    def fresh(self) -> list[NodeInfo] | None:
        """Any thread: the registered nodes for one call without reading the registry,
        or None when the call must read it first (never read, empty, or stale after an
        idle spell). Marks the client as in use: the background reads resume, after the
        call's own read when it must read (``_resume``), not beside it. A call given the
        list while the last read failed counts an index fault: it decides on the last
        list it has."""
        # _dormant is read after _used_at is written, and _keep_fresh writes _dormant
        # before it reads _used_at: one of the two sees the other (no lost wake-up)
        self._used_at = time.monotonic()
        nodes, at = self._nodes, self._nodes_at
        idle = self._dormant or self._reader is None  # no background reads: this call must read
        # no node at all: the registry may have lost them (an index restart) and be
        # filled again by now, so the call reads it rather than miss for a refresh
        if not nodes or at is None or (idle and time.monotonic() - at > self._stale_after):
            return None
        self._resume()
        if self._read_failed:
            self.stats.index_errors += 1
        return nodes

    def cached(self) -> list[NodeInfo] | None:
        """Any thread: the registered nodes as last read while they are fresh, else None;
        reads nothing and marks nothing."""
        nodes, at = self._nodes, self._nodes_at
        return nodes if at is not None and time.monotonic() - at <= self._stale_after else None

    def last(self) -> list[NodeInfo]:
        """The registered nodes as last read, however old (any thread)."""
        return self._nodes

    def _resume(self) -> None:
        """Any thread, for a call that marked the client in use (``fresh``): background
        reads resume if they had stopped. A call that read the registry itself resumes
        them after its read: woken at its start, the reader read the registry beside it
        (a lookup after 8 s of quiet, bench/lookup.py)."""
        if self._dormant:
            self._wake_reader()

    def _wake_reader(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                loop.call_soon_threadsafe(wake.set)

    async def _keep_fresh(self) -> None:
        """Read the registry every ``refresh`` seconds while the client is in use; sooner
        when a node failed (``failed``); not at all while it is idle."""
        assert self._wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._refresh)
            self._wake.clear()
            if time.monotonic() - self._used_at > KEEP_FRESH_S:
                self._dormant = True  # written before _used_at is read again: see fresh
                if time.monotonic() - self._used_at > KEEP_FRESH_S:
                    await self._wake.wait()
                # dormant until the list is fresh again: calls meanwhile read the registry
                # themselves (fresh), none takes the stale list as the reader's
                at = self._nodes_at
                if at is None or time.monotonic() - at >= self._refresh:
                    await self._read()  # else the call that woke it read the list (offered)
                self._dormant = False
                self._wake.clear()  # the calls of that spell woke it: one read for all
                continue
            await self._read()

    async def _read(self) -> None:
        """Read the registry; on failure the last list stays (its nodes still serve). A
        call reads on its own rather than join a read in flight, which may have been
        sent before the registry answered again."""
        at = time.monotonic()
        try:
            self._keep(await self.index.live_nodes(), at)
        except RemoteFault as exc:
            self._keep(exc, at)

    def offered(self, read: list[NodeInfo] | Exception, at: float) -> list[NodeInfo]:
        """Any thread: the nodes for a call that found the list stale (``fresh`` gave
        None) and read the registry in its own round trip (a lookup ``with_nodes``),
        sent at ``at`` (monotonic): the list it read, which the client keeps unless a
        newer one is there; after a failed read the last list, however old, and an
        index fault counted, as ``current`` does."""
        self._keep(read, at)
        self._resume()
        if isinstance(read, Exception):
            self.stats.index_errors += 1
            return self._nodes
        return read

    def _keep(self, read: list[NodeInfo] | Exception, at: float) -> None:
        """A read of the registry sent at ``at``: its list replaces an older one; a
        failure leaves the last list (its nodes still serve) and is logged once until a
        read succeeds. Any thread (the background reads, and calls that read)."""
        if isinstance(read, Exception):
            if not self._read_failed:
                log.warning(
                    "cannot list nodes (using the last list until the registry answers): %s", read
                )
            self._read_failed = True
            return
        with self._keep_lock:
            if self._nodes_at is None or at > self._nodes_at:
                self._note_changes(self._nodes if self._nodes_at is not None else read, read)
                self._nodes, self._nodes_at = read, at
        self._read_failed = False

    def _note_changes(self, before: list[NodeInfo], after: list[NodeInfo]) -> None:
        """Name a node that left the registry (its heartbeats stopped reaching the
        index: it died or is cut off from it, apart from one that is only slow, which
        stays listed) and one that came back, so a log says which it was."""
        gone = {n.node_id for n in before} - {n.node_id for n in after}
        back = {n.node_id for n in after} - {n.node_id for n in before}
        self.stats.nodes_left += len(gone)
        for node_id in sorted(gone):
            log.warning(
                "node %s left the registry (dead, or cut off from the index): its pages "
                "count as missing until it registers again",
                node_id,
            )
        for node_id in sorted(back):
            log.info("node %s is in the registry", node_id)

    async def connect(self, timeout: float, namespace: NamespaceKey) -> None:
        """Open a connection to every live node now (client start) and ask each for one
        page it does not hold, so that the first request pays neither the connection
        nor the node's first look at ``namespace`` and this client's credential
        (measured: a first 64 MiB same-host insert 1.45x a warm one without this probe,
        1.23x with it). A node that cannot be reached, or refuses, is left to the first
        request, which treats it as it would then."""
        nodes = await self.live()
        await asyncio.gather(*(self._connect(node, timeout, namespace) for node in nodes))

    async def _connect(self, node: NodeInfo, timeout: float, namespace: NamespaceKey) -> None:
        probe = Span(np.zeros(1, dtype=np.uint8), 0, 1)
        try:
            await self.on_node(
                node, lambda c: c.get(namespace, [bytes(16)], [probe], [0], timeout, probe=True)
            )
        except NodeRefusedError as exc:
            if exc.credentials:  # what a caller's start line reports (KVCacheClient.start_status)
                self.refused_at_start[node.node_id] = exc.message
            log.info("%s refused the start probe: %s", node.node_id, exc)
        except RemoteFault as exc:
            log.info("cannot reach %s at start: %s", node.node_id, exc)

    def prefer(self, page_hash: bytes, locs: list[PageLocation]) -> list[PageLocation]:
        """A page's replicas in the order to try them: healthy nodes first, each group in
        rendezvous order (so readers of a page agree on a node and its cache stays warm)."""
        order = {n: r for r, n in enumerate(rank_nodes(page_hash, [loc.node_id for loc in locs]))}
        return sorted(locs, key=lambda loc: (loc.node_id in self._suspect, order[loc.node_id]))

    def _latest(self, node: NodeInfo) -> NodeInfo:
        """``node`` as the registry last named it: a call planned on an older list
        reaches a restarted node at its new address and socket."""
        return next((n for n in self._nodes if n.node_id == node.node_id), node)

    def _conn(self, node: NodeInfo) -> NodeConnection | ShmConnection:
        """The connection to ``node``: shared memory when it runs on this host (same
        kernel) and its Unix socket has not failed for this incarnation, else UCX."""
        conn = self._conns.get(node.node_id)
        if (
            conn is None
            or conn.broken
            or conn.node.address != node.address
            or conn.node.incarnation != node.incarnation
        ):
            same_host = (
                self.same_host and node.extra.get("shm") and node.extra.get("host") == host_id()
            )
            if same_host and self._shm_failed.get(node.node_id) != node.incarnation:
                conn = ShmConnection(node, self._token, self.device)
            else:
                conn = NodeConnection(node, self._token, self.ucxx, self.device)
            self._conns[node.node_id] = conn
        return conn

    async def on_node(
        self, node: NodeInfo, work: Any
    ) -> tuple[Any, NodeConnection | ShmConnection]:
        """``await work(conn)`` on the connection to ``node``. When the node's Unix socket
        cannot be reached from here (a directory not shared with this container, say),
        the same call goes over UCX, as does every later one to this incarnation: a
        healthy node must not look dead. A request that found its connection closed by
        another (a refusal, a failure) before it sent anything goes on a new one."""
        node = self._latest(node)
        conn = self._conn(node)
        try:
            return await work(conn), conn
        except ClosedBeforeUseError as exc:
            # another request closed it first: a new connection, once; the node closed it
            # (a restart): the registry names its new incarnation, read it first
            if isinstance(exc, NodeClosedBeforeUseError):
                await self._read()
                node = self._latest(node)
            conn = self._conn(node)
            return await work(conn), conn
        except SameHostUnavailableError as exc:
            self._shm_failed[node.node_id] = node.incarnation
            self.log_limit.warning(
                f"no shm {node.node_id}",
                "same-host path to %s unavailable, using UCX: %s",
                node.node_id,
                exc,
            )
            conn = self._conn(node)
            return await work(conn), conn

    def failed(self, node_id: str, exc: Exception) -> None:
        """``node_id`` failed a call: skip it for a while, read the registry again."""
        self.stats.node_errors += 1
        self.stats.node_timeouts += isinstance(exc, TransportTimeoutError)
        strikes = self._strikes.get(node_id, 0) + 1
        self._strikes[node_id] = strikes
        self._suspect[node_id] = time.monotonic() + min(
            SUSPECT_FIRST * 2 ** (strikes - 1), SUSPECT_MAX
        )
        if self._wake is not None:
            self._wake.set()  # read the registry now: the node may have gone
        # the line names which it was: silent (slow, stalled, cut off) or failed (gone)
        what = "did not answer in time" if isinstance(exc, TransportTimeoutError) else "failed"
        self.log_limit.warning(
            f"failed {node_id}",
            "node %s %s, its pages count as missing for %.1f s: %s",
            node_id,
            what,
            min(SUSPECT_FIRST * 2 ** (strikes - 1), SUSPECT_MAX),
            exc,
        )

    def ok(self, node_id: str) -> None:
        """``node_id`` answered: its earlier failures are forgiven."""
        self._strikes.pop(node_id, None)

    async def close(self) -> None:
        """Stop the background reads and close every connection."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        for conn in self._conns.values():
            await conn.close()
        self._conns.clear()
