"""A storage node's lifecycle: pool, listener, registration, heartbeat, shutdown.

``StorageNode.run`` is what ``kvstore server`` and ``python -m server`` execute. On
SIGTERM or SIGINT the node stops taking requests, lets transfers in flight finish
(bounded by ``shutdown_grace``), deregisters so its pages stop matching, and returns."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from kvstore.config import ServerSettings
from kvstore.errors import KVStoreError
from kvstore.index import AsyncPageIndex
from kvstore.transport import ensure_ucx
from server.dataplane import DataPlane
from server.eviction import Evictor, NodeIdentity
from server.health import start_health_server
from server.metrics import NodeMetrics
from server.pool import MemoryPool
from server.store import PageStore

log = logging.getLogger(__name__)


class StorageNode:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.identity = NodeIdentity(settings.node_id)
        self.metrics = NodeMetrics()
        self.pool = MemoryPool(settings.capacity, settings.hugepages)
        self.store = PageStore(self.pool, settings.slab_size)
        self.metrics.capacity.set(self.store.capacity)
        self.index = AsyncPageIndex(settings.redis_url, password=settings.redis_password.get_secret_value() or None)
        self.node_ttl_ms = int(settings.node_ttl * 1000)
        self.evictor = Evictor(self.store, self.index, self.metrics, self.identity, settings.high_watermark, settings.low_watermark)
        self.dataplane = DataPlane(
            self.store, self.index, self.evictor, self.metrics, self.identity,
            token=settings.auth_token.get_secret_value(), timeout=settings.transfer_timeout, node_ttl_ms=self.node_ttl_ms,
        )
        self._last_heartbeat = 0.0
        self._stop = asyncio.Event()
        self.address = ""
        self.metrics_port: int | None = None
        self._extra: dict[str, str] = {"pid": str(os.getpid())}  # published in the registry

    def ready(self) -> bool:
        """Registered, and the last heartbeat reached the index within the node TTL."""
        return self.identity.epoch > 0 and time.monotonic() - self._last_heartbeat < self.settings.node_ttl

    async def run(self) -> None:
        s = self.settings
        if s.ucx_net_devices:
            os.environ["UCX_NET_DEVICES"] = s.ucx_net_devices
        if s.ucx_tls:
            os.environ["UCX_TLS"] = s.ucx_tls
        ucxx = ensure_ucx(s.ucx_progress_mode)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        listener = ucxx.create_listener(self.dataplane.serve, port=s.port)
        self.address = f"{s.host}:{listener.port}"
        if s.metrics_port is not None:
            http = start_health_server(s.metrics_host, s.metrics_port, self.metrics.registry, self.ready)
            self.metrics_port = http.server_port
            self._extra["metrics"] = f"{s.host}:{self.metrics_port}"
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        print(f"kvstore-server node={s.node_id} address={self.address} metrics_port={self.metrics_port} pool={self.pool.backing}", flush=True)
        await self._stop.wait()
        log.info("shutting down: %d requests in flight", self.dataplane.active)
        self.dataplane.closing = True
        listener.close()
        try:
            await asyncio.wait_for(self.dataplane.idle.wait(), s.shutdown_grace)
        except asyncio.TimeoutError:
            log.warning("shutdown grace over with %d requests in flight", self.dataplane.active)
        heartbeat.cancel()
        await self._deregister()
        await self.index.close()

    async def _heartbeat_loop(self) -> None:
        """Register (new epoch) until it succeeds, then refresh the registry entry and
        the liveness mirror of every namespace this node holds pages of."""
        while True:
            try:
                epoch = await self.index.register_node(
                    self.identity.node_id, self.address, self.store.capacity, self.node_ttl_ms, self.identity.epoch, self._extra
                )
                if self.identity.epoch == 0:
                    log.info("registered as %s epoch %d at %s", self.identity.node_id, epoch, self.address)
                self.identity.epoch = epoch
                if namespaces := self.store.namespaces():
                    await self.index.touch_namespaces(namespaces, self.identity.node_id, epoch, self.node_ttl_ms)
                self._last_heartbeat = time.monotonic()
            except KVStoreError as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.settings.heartbeat_interval)

    async def _deregister(self) -> None:
        if not self.identity.epoch:
            return
        try:
            if namespaces := self.store.namespaces():
                await self.index.touch_namespaces(namespaces, self.identity.node_id, self.identity.epoch, 0)
            await self.index.deregister_node(self.identity.node_id, self.identity.epoch)
        except KVStoreError as exc:
            log.warning("could not deregister (pages expire with the node TTL): %s", exc)
