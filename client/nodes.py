"""The storage nodes as one client sees them: the registry (read again every
``node_refresh`` seconds), which nodes failed recently (suspects), and one connection
per node (shared memory on this host, UCX elsewhere)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np

from client.buffers import Span
from client.connection import ClosedBeforeUseError, NodeConnection, NodeRefusedError, SameHostUnavailableError, ShmConnection
from client.placement import rank_nodes
from client.stats import ClientStats
from kvstore.errors import RemoteFault
from kvstore.index import AsyncPageIndex, NodeInfo, PageLocation
from kvstore.pages.keys import NamespaceKey
from kvstore.wire.shm import host_id

log = logging.getLogger(__name__)
# A node that failed is skipped for SUSPECT_FIRST seconds, doubling with every further
# failure up to SUSPECT_MAX, and forgiven on its first success: a node back from a
# stall serves again within about a second, one that stays dead is not hammered.
SUSPECT_FIRST = 0.5
SUSPECT_MAX = 8.0


class NodeDirectory:
    """``AsyncKVCacheClient``'s view of the nodes; only its event loop's thread calls it.
    ``ucxx`` is set by the client's ``start``."""

    def __init__(self, index: AsyncPageIndex, stats: ClientStats, *, token: str, same_host: bool, refresh: float) -> None:
        self.index = index
        self.stats = stats
        self.ucxx: Any = None
        self.same_host = same_host
        self._token = token
        self._refresh = refresh
        self._nodes: list[NodeInfo] = []
        self._nodes_at = 0.0
        self._conns: dict[str, NodeConnection | ShmConnection] = {}
        self._shm_failed: dict[str, str] = {}  # node id -> incarnation whose Unix socket failed
        self._suspect: dict[str, float] = {}  # node id -> skipped until (monotonic)
        self._strikes: dict[str, int] = {}  # node id -> failures since its last success
        self.refused_at_start: dict[str, str] = {}  # node id -> why it refused this client's token at start

    async def live(self, include_suspect: bool = False) -> list[NodeInfo]:
        """Registered nodes from a cache refreshed every ``refresh`` seconds; nodes that
        failed recently are left out unless ``include_suspect``."""
        now = time.monotonic()
        if now - self._nodes_at > self._refresh or not self._nodes:
            try:
                self._nodes = await self.index.live_nodes()
                self._nodes_at = now
            except RemoteFault as exc:
                self.stats.index_errors += 1
                log.warning("cannot list nodes: %s", exc)
        for node_id in [n for n, until in self._suspect.items() if until < now]:
            del self._suspect[node_id]
        return [n for n in self._nodes if include_suspect or n.node_id not in self._suspect]

    def cached(self) -> list[NodeInfo] | None:
        """The registered nodes, suspects included, while the cache is fresh; else None
        (``live`` reads the registry again). Any thread may call it: it reads two
        attributes the loop thread replaces whole, never a structure it mutates."""
        nodes, at = self._nodes, self._nodes_at
        return nodes if nodes and time.monotonic() - at <= self._refresh else None

    def last(self) -> list[NodeInfo]:
        """The registered nodes as last read, however old (any thread)."""
        return self._nodes

    def adopt(self, nodes: list[NodeInfo], read_at: float) -> None:
        """Loop thread: take a registry read made elsewhere (``KVCacheClient.find``,
        in the caller's thread) unless a newer one is in already."""
        if read_at > self._nodes_at:
            self._nodes, self._nodes_at = nodes, read_at

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
            await self.on_node(node, lambda c: c.get(namespace, [bytes(16)], [probe], [0], timeout, probe=True))
        except NodeRefusedError as exc:
            if exc.credentials:  # what a caller's start line reports (KVCacheClient.start_status)
                self.refused_at_start[node.node_id] = exc.message
            log.info("%s refused the start probe: %s", node.node_id, exc)
        except RemoteFault as exc:
            log.info("cannot reach %s at start: %s", node.node_id, exc)

    def prefer(self, page_hash: bytes, locs: list[PageLocation]) -> list[PageLocation]:
        """A page's replicas in the order to try them: healthy nodes first, each group in
        rendezvous order (so readers of a page agree on a node and its cache stays warm)."""
        order = {n: r for r, n in enumerate(rank_nodes(page_hash, [l.node_id for l in locs]))}
        return sorted(locs, key=lambda l: (l.node_id in self._suspect, order[l.node_id]))

    def _conn(self, node: NodeInfo) -> NodeConnection | ShmConnection:
        """The connection to ``node``: shared memory when it runs on this host (same
        kernel) and its Unix socket has not failed for this incarnation, else UCX."""
        conn = self._conns.get(node.node_id)
        if conn is None or conn.broken or conn.node.address != node.address or conn.node.incarnation != node.incarnation:
            same_host = self.same_host and node.extra.get("shm") and node.extra.get("host") == host_id()
            if same_host and self._shm_failed.get(node.node_id) != node.incarnation:
                conn = ShmConnection(node, self._token)
            else:
                conn = NodeConnection(node, self._token, self.ucxx)
            self._conns[node.node_id] = conn
        return conn

    async def on_node(self, node: NodeInfo, work: Any) -> tuple[Any, NodeConnection | ShmConnection]:
        """``await work(conn)`` on the connection to ``node``. When the node's Unix socket
        cannot be reached from here (a directory not shared with this container, say),
        the same call goes over UCX, as does every later one to this incarnation: a
        healthy node must not look dead. A request that found its connection closed by
        another (a refusal, a failure) before it sent anything goes on a new one."""
        conn = self._conn(node)
        try:
            return await work(conn), conn
        except ClosedBeforeUseError:  # another request closed it first: a new one, once
            conn = self._conn(node)
            return await work(conn), conn
        except SameHostUnavailableError as exc:
            self._shm_failed[node.node_id] = node.incarnation
            log.warning("same-host path to %s unavailable, using UCX: %s", node.node_id, exc)
            conn = self._conn(node)
            return await work(conn), conn

    def failed(self, node_id: str, exc: Exception) -> None:
        """``node_id`` failed a call: skip it for a while, read the registry again."""
        self.stats.node_errors += 1
        strikes = self._strikes.get(node_id, 0) + 1
        self._strikes[node_id] = strikes
        self._suspect[node_id] = time.monotonic() + min(SUSPECT_FIRST * 2 ** (strikes - 1), SUSPECT_MAX)
        self._nodes_at = 0.0  # re-read the registry on the next call
        log.warning("node %s failed, its pages count as missing: %s", node_id, exc)

    def ok(self, node_id: str) -> None:
        """``node_id`` answered: its earlier failures are forgiven."""
        self._strikes.pop(node_id, None)

    async def close(self) -> None:
        for conn in self._conns.values():
            await conn.close()
        self._conns.clear()
