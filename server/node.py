"""A storage node: its parts wired together, and its life from start to shutdown.

``StorageNode.run`` is what ``kvstore server`` and ``python -m server`` execute. On
SIGTERM or SIGINT the node stops taking requests, lets transfers in flight finish
(bounded by ``shutdown_grace``), deregisters so its pages stop matching, and returns.

The parts, bottom up: the page memory (server/pool.py) and the page table
(server/store.py); the retirer, which takes pages off the node in step with the
index (server/retire.py); the tier below memory (server/tier.py: the disk tier,
server/disk/, or none); the evictor (server/eviction.py); the data plane
(server/dataplane/); the listeners (ucxx's, and server/accept.py's); the registry
entry (server/registry.py); /metrics and the health endpoints (server/health.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from kvstore.errors import KVStoreError
from kvstore.events import PROFILES, PublisherOptions
from kvstore.index import AsyncPageIndex, PageIndex
from kvstore.security.credentials import CredentialFile
from kvstore.settings.config import ServerSettings
from kvstore.settings.events import token_tenants
from kvstore.wire.shm import host_id
from kvstore.wire.transport import ensure_ucx, listen
from server.accept import SameHostListener
from server.control.http import ControlAPI
from server.control.metrics import ControlMetrics
from server.control.ops import NodeControl
from server.control.pins import PinBook
from server.dataplane import DataPlane, RequestLimits
from server.dataplane.namespaces import NamespaceCache
from server.dataplane.readthrough import ReadThrough
from server.disk.demoter import TierPolicy
from server.disk.tier import open_disk_tier
from server.events import NodeEvents, event_access
from server.eviction import Evictor
from server.health import LoopWatchdog, start_health_server
from server.heap import HeapTrimmer
from server.identity import NodeIdentity
from server.limits import HandshakeFailures, connection_budget, raise_descriptor_limit
from server.metrics import NodeMetrics
from server.pool import MemoryPool
from server.query import PrefixQuery
from server.registry import Registrar
from server.retire import Retirer
from server.store import PageStore
from server.tier import NoTier, Tier

log = logging.getLogger(__name__)


class StorageNode:
    """Builds a storage node's parts from its settings, then runs them: starts them,
    serves until told to stop, and shuts them down in order."""

    def __init__(self, settings: ServerSettings) -> None:
        s = self.settings = settings
        self.identity = NodeIdentity(s.node_id)
        self.metrics = NodeMetrics()
        descriptors = raise_descriptor_limit()  # before the pool, which holds a memfd per slab
        self.pool = MemoryPool(s.capacity, s.slab_size, s.hugepages, s.hugepage_size)
        self.index = AsyncPageIndex(
            s.redis_url, password=s.redis_password.get_secret_value() or None
        )
        namespaces = NamespaceCache(self.index)
        self.credentials = CredentialFile(s.credentials_file, s.auth_token.get_secret_value())
        self.events = self._events(namespaces)
        self.store = PageStore(self.pool, self.events)
        self.metrics.capacity.set(self.store.capacity)
        connections = s.max_connections or connection_budget(descriptors, len(self.pool.regions))
        retirer = Retirer(self.store, self.index, self.identity, self.metrics)
        self.tier = self._tier(retirer)
        self.evictor = Evictor(
            self.store,
            retirer,
            self.tier,
            self.metrics,
            s.high_watermark,
            s.low_watermark,
            tenant_quota=int(s.tenant_quota * self.store.capacity),
        )
        self.dataplane = DataPlane(
            self.store,
            self.index,
            self.evictor,
            self.tier,
            self.metrics,
            self.identity,
            namespaces,
            credentials=self.credentials,
            timeout=s.transfer_timeout,
            min_put_rate=s.min_put_rate,
            limits=RequestLimits(
                s.max_request_pages,
                s.max_request_bytes or self.store.capacity,
                connections,
                s.frame_timeout,
            ),
        )
        self.metrics.watch(self.store, self.dataplane)
        self.control = self._control()
        self.watchdog = LoopWatchdog(limit=max(10.0, 3 * s.heartbeat_interval))
        self._stop = asyncio.Event()
        self.registrar = Registrar(
            self.identity,
            self.index,
            self.store,
            namespaces,
            self.tier,
            self.metrics,
            HeapTrimmer(self.dataplane),
            self._stop,
            heartbeat_interval=s.heartbeat_interval,
            node_ttl=s.node_ttl,
        )
        self.metrics.index_up.set_function(lambda: float(self.registrar.ready()))
        self.metrics.heartbeat_age.set_function(self.registrar.heartbeat_age)
        self.metrics.loop_lag.set_function(lambda: self.watchdog.lag)
        self.address = ""
        self.metrics_port: int | None = None

    def _events(self, namespaces: NamespaceCache) -> NodeEvents | None:
        """The KV-event publisher with ``--kv-events-endpoint`` (binding fails here, at
        start), else None."""
        s = self.settings
        if not s.kv_events_endpoint:
            return None
        options = PublisherOptions(
            endpoint=s.kv_events_endpoint,
            replay_endpoint=s.kv_events_replay_endpoint,
            max_queue_events=s.kv_events_queue,
        )
        store_id = s.kv_events_store_id or s.node_id
        checks_tokens = self.credentials.enabled
        return NodeEvents(
            options,
            store_id,
            namespaces.get,
            self.metrics.registry,
            token_tenants=token_tenants(s, checks_tokens=checks_tokens),
            access=event_access(s, store_id),
            profile=PROFILES[s.kv_events_profile],
        )

    def _control(self) -> NodeControl:
        """The control API's actions (server/control/), with the pins the disk tier's
        pins file names pinned again."""
        s = self.settings
        metrics = ControlMetrics(self.metrics.registry)
        capacity = self.store.capacity
        pins = PinBook(
            capacity, int(s.tenant_quota * capacity), s.pin_max_share, s.disk_path, metrics
        )
        pins.restore(self.store.pages)
        readthrough = ReadThrough(self.store, self.evictor, self.tier, self.metrics)
        return NodeControl(
            self.store,
            self.index,
            self.identity,
            self.tier,
            readthrough,
            pins,
            metrics,
            s.clear_grace,
        )

    def _post(self) -> ControlAPI:
        """The POST handler of the metrics port: the control API, and the prefix query
        API (server/query.py) behind it, with a blocking index connection of its own:
        they run on the HTTP server's threads, not on the event loop."""
        s = self.settings
        index = PageIndex(s.redis_url, password=s.redis_password.get_secret_value() or None)
        query = PrefixQuery(
            index, self.credentials, self.store, s.node_id, residency=self.control.residency
        )
        return ControlAPI(query, self.control, asyncio.get_running_loop())

    async def _announce_start(self) -> None:
        """Send what the tier recovered, or, when the node starts with no page (no disk
        tier, or an empty one), ``AllBlocksCleared`` under every model the index's
        namespace registry names: a router drops what an earlier run announced."""
        events = self.events
        if events is None:
            return
        if self.store.ready_pages:
            events.flush()
            return
        try:
            async with asyncio.timeout(5):
                stats = await self.index.stats()
        except (KVStoreError, TimeoutError) as exc:
            log.warning(
                "KV events: no AllBlocksCleared sent, the index's namespaces are unknown: %s", exc
            )
            return
        events.cleared(
            [
                (space.namespace.tenant, space.namespace.model)
                for space in stats.namespaces
                if space.namespace is not None
            ]
        )

    def _tier(self, retirer: Retirer) -> Tier:
        """The tier below memory: the disk tier with the pages a previous run left on
        disk, or none without ``--disk-path``."""
        s = self.settings
        if not s.disk_path:
            return NoTier()
        policy = TierPolicy(s.disk_policy, s.disk_admission, s.disk_queue_depth, s.tenant_quota)
        return open_disk_tier(
            s.disk_path,
            s.disk_capacity,
            s.slab_size,
            policy,
            self.store,
            retirer,
            self.metrics,
            s.high_watermark,
            s.low_watermark,
        )

    async def run(self) -> None:
        s = self.settings
        if s.ucx_net_devices:
            os.environ["UCX_NET_DEVICES"] = s.ucx_net_devices
        if s.ucx_tls:
            os.environ["UCX_TLS"] = s.ucx_tls
        ucxx = ensure_ucx(s.ucx_progress_mode)
        handshakes = HandshakeFailures(self.metrics.handshake_failures)
        logging.getLogger("ucx").addFilter(handshakes)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        listener = listen(ucxx, self.dataplane.serve, s.port)
        self.address = f"{s.host}:{listener.port}"
        # published in the registry; put_tokens: puts may carry token ids; get_parts: a
        # same-host get's plan may come in parts (a client sends either field only to
        # nodes that say so: an older node refuses it); slab_bytes: the pool's slab size,
        # by which a same-host client finds an index slot in the slabs it mapped (and the
        # node takes SLOT_READS notices)
        extra = {"pid": str(os.getpid()), "put_tokens": "1", "get_parts": "1"}
        unix = (
            SameHostListener(s.shm_dir, s.node_id, self.dataplane, self.metrics)
            if s.shm_dir
            else None
        )
        if unix is not None and unix.start():
            extra.update(shm=unix.path, host=host_id(), slab_bytes=str(self.pool.slab_size))
        if s.metrics_port is not None:
            http = start_health_server(
                s.metrics_host,
                s.metrics_port,
                self.metrics.registry,
                self.registrar.ready,
                self.watchdog.alive,
                self.tier.status_lines,
                post=self._post().handle,
            )
            self.metrics_port = http.server_port
            extra["metrics"] = f"{s.host}:{self.metrics_port}"
        await self._announce_start()
        self.tier.start()
        self.control.start()
        heartbeat = self.registrar.start(self.address, extra)
        watchdog = self.watchdog.start()
        print(
            f"kvstore-server node={s.node_id} address={self.address} metrics_port={self.metrics_port} "
            f"pool={self.pool.backing} max_connections={self.dataplane.limits.connections}",
            flush=True,
        )
        await self._stop.wait()
        log.info("shutting down: %d requests in flight", self.dataplane.active)
        self.dataplane.closing = True
        listener.close()
        if unix is not None:
            unix.close()
        try:
            await asyncio.wait_for(self.dataplane.idle.wait(), s.shutdown_grace)
        except TimeoutError:
            log.warning("shutdown grace over with %d requests in flight", self.dataplane.active)
        heartbeat.cancel()
        watchdog.cancel()
        await self.tier.stop()
        if self.events is not None:
            self.events.close()
        await self.registrar.deregister()
        await self.index.close()
        logging.getLogger("ucx").removeFilter(handshakes)
        if self.registrar.fatal is not None:
            raise self.registrar.fatal
