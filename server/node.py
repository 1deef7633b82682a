"""A storage node's lifecycle: pool, listener, registration, heartbeat, shutdown.

``StorageNode.run`` is what ``kvstore server`` and ``python -m server`` execute. On
SIGTERM or SIGINT the node stops taking requests, lets transfers in flight finish
(bounded by ``shutdown_grace``), deregisters so its pages stop matching, and returns.

The index is kept in step with the page table by one mechanism: whenever the node
cannot be sure the index matches what it holds (the index no longer accepts its
incarnation because it lost its data or was restored from an old snapshot, or an
eviction could not be removed from it), the node registers a new incarnation, which
hides every entry of the old one at once, and re-publishes its namespaces and every
page it holds."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import re
import signal
import socket
import time

from kvstore.errors import Fault, FencedError, IndexUnavailableError, NodeIdInUseError
from kvstore.index import AsyncPageIndex, Registration
from kvstore.pages.keys import NamespaceKey
from kvstore.security.credentials import CredentialFile
from kvstore.settings.config import ServerSettings
from kvstore.wire.shm import host_id
from kvstore.wire.transport import ensure_ucx, listen
from server.dataplane import DataPlane, RequestLimits
from server.disk.files import DiskFiles
from server.disk.recovery import recover
from server.disk.tier import DiskTier, TierPolicy
from server.eviction import Evictor, NodeIdentity
from server.health import LoopWatchdog, start_health_server
from server.limits import HandshakeFailures, RateLimitedLog, connection_budget, raise_descriptor_limit
from server.metrics import NodeMetrics
from server.pool import MemoryPool
from server.store import PageState, PageStore, commit_entry

log = logging.getLogger(__name__)
# An accept that fails (EMFILE, ENFILE, ENOBUFS) is retried after this long, doubling
# up to ACCEPT_BACKOFF_MAX: the listener outlives any burst of failures.
ACCEPT_BACKOFF = 0.05
ACCEPT_BACKOFF_MAX = 1.0
# Every client connection leaves freed but unreturned heap behind in UCX and ucxx
# (measured: node RSS +370 B per connect/disconnect, of which malloc_trim gives back
# about 85 %), so the node hands free heap back to the kernel now and then.
TRIM_INTERVAL = 30.0
_LIBC = ctypes.CDLL(None)


def release_free_heap() -> None:
    """glibc's malloc_trim: return free heap pages to the kernel (no-op elsewhere)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


class StorageNode:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.identity = NodeIdentity(settings.node_id)
        self.metrics = NodeMetrics()
        descriptors = raise_descriptor_limit()  # before the pool, which holds a memfd per slab
        self.pool = MemoryPool(settings.capacity, settings.slab_size, settings.hugepages, settings.hugepage_size)
        self.store = PageStore(self.pool)
        self.metrics.capacity.set(self.store.capacity)
        connections = settings.max_connections or connection_budget(descriptors, len(self.pool.regions))
        self.index = AsyncPageIndex(settings.redis_url, password=settings.redis_password.get_secret_value() or None)
        self.node_ttl_ms = int(settings.node_ttl * 1000)
        self.evictor = Evictor(self.store, self.index, self.metrics, self.identity, settings.high_watermark, settings.low_watermark,
                               tenant_quota=int(settings.tenant_quota * self.store.capacity))
        self.dataplane = DataPlane(
            self.store, self.index, self.evictor, self.metrics, self.identity,
            credentials=CredentialFile(settings.credentials_file, settings.auth_token.get_secret_value()), timeout=settings.transfer_timeout, min_put_rate=settings.min_put_rate,
            limits=RequestLimits(settings.max_request_pages, settings.max_request_bytes or self.store.capacity, connections, settings.frame_timeout),
        )
        self.metrics.watch(self.store, self.dataplane)
        self._predecessor = ""  # the incarnation the disk tier's last run registered
        self.tier = self._disk_tier() if settings.disk_path else None
        self.dataplane.tier = self.tier
        self.watchdog = LoopWatchdog(limit=max(10.0, 3 * settings.heartbeat_interval))
        self._started = time.monotonic()
        self._last_heartbeat = 0.0
        self.metrics.index_up.set_function(lambda: float(self.ready()))
        self.metrics.heartbeat_age.set_function(lambda: time.monotonic() - (self._last_heartbeat or self._started))
        self.metrics.loop_lag.set_function(lambda: self.watchdog.lag)
        self._stop = asyncio.Event()
        self.address = ""
        self.metrics_port: int | None = None
        self._extra: dict[str, str] = {"pid": str(os.getpid())}  # published in the registry
        self.fatal: Exception | None = None  # why the node stopped by itself
        self._trimmed = 0.0

    def _disk_tier(self) -> DiskTier:
        """The disk tier under the pool, with the pages a previous run left on disk."""
        s = self.settings
        files = DiskFiles(s.disk_path, s.disk_capacity, s.slab_size, s.disk_queue_depth)
        if not files.direct:
            log.warning("disk tier: %s refuses O_DIRECT (tmpfs, overlay?): using buffered I/O (kvstore_disk_direct_io 0)", s.disk_path)
        tier = DiskTier(self.store, files, self.index, self.evictor, self.metrics,
                        TierPolicy(s.disk_policy, s.disk_admission, s.disk_queue_depth, s.tenant_quota), s.high_watermark, s.low_watermark)
        self.metrics.watch_disk(tier)
        recover(tier)
        self._predecessor = str(files.state.get("incarnation", ""))
        return tier

    def status_lines(self) -> list[str]:
        """What /healthz adds to its body: a degraded disk tier (the node still serves)."""
        if self.tier is not None and self.tier.degraded:
            return [f"disk tier degraded: {self.tier.degraded}"]
        return []

    def ready(self) -> bool:
        """Registered, and the last heartbeat reached the index within the node TTL."""
        return bool(self.identity.incarnation) and time.monotonic() - self._last_heartbeat < self.settings.node_ttl

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
        unix = self._listen_unix() if s.shm_dir else None
        if s.metrics_port is not None:
            http = start_health_server(s.metrics_host, s.metrics_port, self.metrics.registry, self.ready, self.watchdog.alive, self.status_lines)
            self.metrics_port = http.server_port
            self._extra["metrics"] = f"{s.host}:{self.metrics_port}"
        if self.tier is not None:
            self.tier.start()
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        watchdog = self.watchdog.start()
        print(f"kvstore-server node={s.node_id} address={self.address} metrics_port={self.metrics_port} pool={self.pool.backing} max_connections={self.dataplane.limits.connections}", flush=True)
        await self._stop.wait()
        log.info("shutting down: %d requests in flight", self.dataplane.active)
        self.dataplane.closing = True
        listener.close()
        if unix is not None:
            unix.cancel()
        try:
            await asyncio.wait_for(self.dataplane.idle.wait(), s.shutdown_grace)
        except asyncio.TimeoutError:
            log.warning("shutdown grace over with %d requests in flight", self.dataplane.active)
        heartbeat.cancel()
        watchdog.cancel()
        if self.tier is not None:
            await self.tier.stop()
        await self._deregister()
        await self.index.close()
        logging.getLogger("ucx").removeFilter(handshakes)
        if self.fatal is not None:
            raise self.fatal

    def _listen_unix(self) -> asyncio.Task | None:
        """Listen for same-host clients (kvstore.wire.shm) on a Unix socket in ``shm_dir``; its
        path and this host's identity go into the registry entry."""
        stem = f"kvstore-{re.sub(r'[^A-Za-z0-9_.-]', '_', self.settings.node_id)}"
        _remove_stale_sockets(self.settings.shm_dir, stem)
        # The pid keeps two stores on one host apart (tests, a second registry).
        path = os.path.join(self.settings.shm_dir, f"{stem}-{os.getpid()}.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o660)  # owner and group: share the group with engine pods
            sock.listen(128)
        except OSError as exc:
            sock.close()
            log.warning("same-host path off: cannot listen on %s: %s", path, exc)
            return None
        sock.setblocking(False)
        self._extra.update(shm=path, host=host_id())
        loop = asyncio.get_running_loop()

        failures = RateLimitedLog(log)

        async def accept() -> None:
            backoff = ACCEPT_BACKOFF
            try:
                while True:
                    try:
                        conn, _ = await loop.sock_accept(sock)
                    except OSError as exc:  # out of descriptors or buffers: wait, never give up the socket
                        self.metrics.accept_errors.inc()
                        failures("same-host accept failed, retrying in %.2f s: %s", backoff, exc)
                        await asyncio.sleep(backoff)
                        backoff = min(2 * backoff, ACCEPT_BACKOFF_MAX)
                        continue
                    backoff = ACCEPT_BACKOFF
                    loop.create_task(self.dataplane.serve_unix(conn))
            finally:
                sock.close()
                try:
                    os.unlink(path)
                except OSError:
                    pass

        return loop.create_task(accept())

    async def _heartbeat_loop(self) -> None:
        """Register until it succeeds, then refresh the registry entry (with the pages
        held per namespace), re-registering (and re-publishing) when the index says the
        incarnation is stale or an index shard restarted."""
        started = time.monotonic()
        run_ids: dict[str, str] = {}  # index shard address -> run id, as last seen
        while True:
            try:
                await self._check_shards(run_ids)
                await self._heartbeat()
                self._trim_heap()
            except NodeIdInUseError as exc:
                # A pod restarted under the same name waits for its predecessor's entry
                # to expire; a second live process with this id is refused for good.
                if time.monotonic() - started > 2 * self.settings.node_ttl:
                    log.error("%s", exc)
                    self.fatal = exc
                    self._stop.set()
                    return
                log.warning("%s; retrying until it expires", exc)
            except Fault as exc:
                log.warning("heartbeat failed: %s", exc)
            except Exception:  # noqa: BLE001 - a bug must not end the heartbeat (the node would expire while serving)
                log.exception("heartbeat failed unexpectedly; retrying")
            await asyncio.sleep(self.settings.heartbeat_interval)

    async def _check_shards(self, run_ids: dict[str, str]) -> None:
        """Flag the index stale when a shard restarted (new run id) or a new primary took
        over (new address): it may have lost what this node published there. A shard
        that is down only shortens prefixes: the heartbeat goes on."""
        for address, run_id in (await self.index.server_ids()).items():
            if run_id is None:
                continue
            if run_ids and run_ids.get(address) != run_id:
                log.warning("index shard %s restarted or took over: re-publishing under a new incarnation", address)
                self.identity.index_stale = True
            run_ids[address] = run_id

    async def _heartbeat(self) -> None:
        """Refresh this incarnation's registry entry, or register a new incarnation (and
        re-publish) when there is none, the index is stale, or the index fences it."""
        if not self.identity.incarnation or self.identity.index_stale:
            await self._register_new()
        else:
            try:
                await self._register(self.identity.incarnation)
            except FencedError as exc:
                log.warning("the index no longer accepts this node (%s): registering a new incarnation", exc)
                await self._register_new()
        self._last_heartbeat = time.monotonic()

    def _trim_heap(self) -> None:
        """Hand free heap back to the kernel now and then, while no request runs."""
        if self._last_heartbeat - self._trimmed > TRIM_INTERVAL and not self.dataplane.active:
            self._trimmed = self._last_heartbeat
            release_free_heap()

    async def _register(self, incarnation: str | None) -> Registration:
        # the registry carries what this node holds, so `kvstore stats` needs no index scan
        pages = json.dumps({ns: n for ns, n in sorted(self.store.namespace_pages.items()) if n > 0}, separators=(",", ":"))
        # After a restart the disk tier names the incarnation its last run registered: the
        # directory's lock proves that process is gone, so the new one takes over at once.
        return await self.index.register_node(
            self.identity.node_id, self.address, self.store.capacity, self.node_ttl_ms, incarnation,
            replaces=self.identity.incarnation or self._predecessor, extra={**self._extra, "pages": pages, **self._usage()},
        )

    def _usage(self) -> dict[str, str]:
        """Pool use and read counters for ``kvstore stats`` (the same figures as /metrics)."""
        sample = self.metrics.registry.get_sample_value
        return {
            "used": str(self.store.used_bytes),
            "hits": str(int(sample("kvstore_get_pages_total") or 0)),
            "misses": str(int(sample("kvstore_get_missing_pages_total") or 0)),
            **({"disk_used": str(self.tier.allocator.used_bytes), "disk_capacity": str(self.tier.files.capacity),
                "disk_pages": str(len(self.store.disk_lru)), "memory_pages": str(self.store.memory_pages),
                "disk_hits": str(int(sample("kvstore_tier_hit_pages_total", {"tier": "disk"}) or 0)),
                "disk_degraded": "1" if self.tier.degraded else "0"} if self.tier is not None else {}),
        }

    async def _register_new(self) -> None:
        """Register a fresh incarnation; if this node held pages under an older one,
        re-publish them (and their namespaces) under the new one."""
        registration = await self._register(None)
        republish = bool(self.identity.incarnation) or self.store.ready_pages > 0  # pages recovered from disk too
        self.identity.incarnation, self.identity.number = registration.incarnation, registration.number
        incarnation = registration.incarnation
        self.identity.index_stale = False  # an eviction that fails from here on flags it again
        log.info("registered as %s incarnation %s at %s", self.identity.node_id, incarnation, self.address)
        if self.tier is not None:
            await asyncio.get_running_loop().run_in_executor(self.tier.files.writers, lambda: self.tier.files.write_state(incarnation=incarnation))
        if republish:
            try:
                await self._republish()
            except BaseException:
                self.identity.index_stale = True
                raise

    async def _republish(self) -> None:
        """Publish every ready page under the current incarnation, namespace by namespace."""
        by_ns: dict[NamespaceKey, list] = {}
        for page in self.store.ready_items():
            by_ns.setdefault(NamespaceKey(page.owner, page.key[0]), []).append(page)
        inc = self.identity.incarnation
        for key, pages in by_ns.items():
            if ns := self.dataplane.namespaces.get(key.digest):
                await self.index.ensure_namespace(ns)
                await self.index.announce_namespace(key)
            for start in range(0, len(pages), 4096):
                chunk = pages[start : start + 4096]
                written = await self.index.commit(key, self.identity.number, inc, [commit_entry(p) for p in chunk])
                if not all(written):
                    raise IndexUnavailableError(f"an index shard failed while re-publishing {key.member}")
                # pages evicted while the commit was on its way must not stay advertised
                if gone := [p for p in chunk if p.state is not PageState.READY]:
                    await self.index.remove(key, self.identity.number, [p.key[1] for p in gone], [p.anchor for p in gone], respect_lease=False)
        log.info("re-published %d pages in %d namespaces", sum(map(len, by_ns.values())), len(by_ns))

    async def _deregister(self) -> None:
        if not self.identity.incarnation:
            return
        try:
            await self.index.deregister_node(self.identity.node_id, self.identity.incarnation)
        except Fault as exc:
            log.warning("could not deregister (pages expire with the node TTL): %s", exc)


def _remove_stale_sockets(directory: str, stem: str) -> None:
    """Unlink Unix sockets that killed nodes of this node id left behind."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        pid = name[len(stem) + 1 : -len(".sock")]
        if name.startswith(stem + "-") and name.endswith(".sock") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
