"""The page index in Redis/Valkey: lookups, two-phase publish, eviction and the node registry.

``PageIndex`` (redis-py sync) and ``AsyncPageIndex`` (redis.asyncio) expose the same
method names. Each method is one Lua script call, so a lookup of any number of
pages is a single command on the server. Clients call ``lookup``; storage nodes
call ``reserve``/``commit``/``remove`` and the registry methods."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore import keys
from kvstore.errors import IndexUnavailableError, InvalidInputError, KVStoreError, UnknownNamespaceError
from kvstore.hashing import HASH_BYTES
from kvstore.namespace import Namespace

DEFAULT_LEASE_MS = 5_000
DEFAULT_RESERVE_TTL_MS = 30_000
# A committed entry of a node that missed heartbeats is only deleted after this grace,
# so a short stall does not wipe a healthy node's pages from the index.
DEFAULT_DEAD_GRACE_MS = 60_000
SCRIPT_NAMES = ("lookup", "reserve", "commit", "remove", "touch_alive", "register", "deregister", "live_nodes")


class ReserveStatus(enum.IntEnum):
    RESERVED = 0
    PRESENT = 1
    IN_FLIGHT = 2


@dataclass(frozen=True, slots=True)
class PageLocation:
    """Where one replica of a page lives: node id, pool slot, size in bytes, checksum."""

    node_id: str
    slot: int
    size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``matched`` leading pages are present; ``locations[i]`` lists page i's live replicas."""

    matched: int
    locations: list[list[PageLocation]]


@dataclass(frozen=True, slots=True)
class CommitEntry:
    page_hash: bytes
    slot: int
    size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A registered storage node as stored in the registry."""

    node_id: str
    address: str
    capacity: int
    epoch: int
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    digest: str
    pages: int
    namespace: Namespace | None


@dataclass(frozen=True, slots=True)
class IndexStats:
    nodes: list[NodeInfo]
    namespaces: list[NamespaceStats]


def redact_url(url: str) -> str:
    """The Redis URL with any password replaced, for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _load_scripts() -> dict[str, str]:
    lua = resources.files("kvstore") / "lua"
    common = (lua / "common.lua").read_text()
    return {name: common + (lua / f"{name}.lua").read_text() for name in SCRIPT_NAMES}


_SCRIPTS = _load_scripts()


def _ns_hex(namespace: Namespace | str) -> str:
    if isinstance(namespace, Namespace):
        return namespace.digest_hex
    text = str(namespace)
    if len(text) != 2 * HASH_BYTES or any(c not in "0123456789abcdef" for c in text):
        raise InvalidInputError(f"namespace digest must be {2 * HASH_BYTES} lowercase hex characters, got {text!r}")
    return text


def _hexes(hashes: Sequence[bytes], what: str) -> str:
    if len(hashes) == 0:
        raise InvalidInputError(f"{what} needs at least one page hash, got an empty list")
    for i, h in enumerate(hashes):
        if not isinstance(h, (bytes, bytearray)) or len(h) != HASH_BYTES:
            size = len(h) if isinstance(h, (bytes, bytearray)) else type(h).__name__
            raise InvalidInputError(f"page hash #{i} must be {HASH_BYTES} bytes, got {size}")
    return b"".join(hashes).hex()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class _Call:
    """One script invocation and how to read its reply; shared by both index flavours."""

    script: str
    keys: list[str]
    args: list[Any]
    parse: Callable[[Any], Any]


class _IndexSpecs:
    """Builds script calls from validated arguments. Pure: no I/O."""

    lease_ms: int
    reserve_ttl_ms: int
    dead_grace_ms: int

    def _spec_lookup(self, namespace: Namespace | str, hashes: Sequence[bytes], lease_ms: int | None) -> _Call:
        ns = _ns_hex(namespace)
        lease = self.lease_ms if lease_ms is None else lease_ms

        def parse(raw: list) -> LookupResult:
            if raw[0] == -1:
                raise UnknownNamespaceError(f"namespace {ns} is not registered in the index")
            locations: list[list[PageLocation]] = []
            if raw[0]:
                for line in _text(raw[1]).split("\n"):
                    replicas = []
                    for loc in line.split(";"):
                        node, slot, size, crc = loc.split("|")
                        replicas.append(PageLocation(node, int(slot), int(size), int(crc)))
                    locations.append(replicas)
            return LookupResult(raw[0], locations)

        args = [keys.namespace_prefix(ns), _hexes(hashes, "lookup"), lease, self.dead_grace_ms]
        return _Call("lookup", [keys.meta_key(ns), keys.alive_key(ns)], args, parse)

    def _spec_reserve(self, namespace: Namespace | str, node_id: str, epoch: int, hashes: Sequence[bytes]) -> _Call:
        ns = _ns_hex(namespace)
        args = [keys.namespace_prefix(ns), node_id, epoch, self.reserve_ttl_ms, _hexes(hashes, "reserve")]
        return _Call("reserve", [keys.meta_key(ns)], args, lambda raw: [ReserveStatus(int(v)) for v in raw])

    def _spec_commit(self, namespace: Namespace | str, node_id: str, epoch: int, entries: Sequence[CommitEntry], node_ttl_ms: int) -> _Call:
        ns = _ns_hex(namespace)
        hexes = _hexes([e.page_hash for e in entries], "commit")
        args = [keys.namespace_prefix(ns), node_id, epoch, node_ttl_ms, hexes]
        args += [f"{e.slot}|{e.size}|{e.checksum}" for e in entries]
        return _Call("commit", [keys.meta_key(ns), keys.alive_key(ns)], args, lambda raw: [bool(v) for v in raw])

    def _spec_remove(self, namespace: Namespace | str, node_id: str, epoch: int, hashes: Sequence[bytes], respect_lease: bool) -> _Call:
        ns = _ns_hex(namespace)
        args = [keys.namespace_prefix(ns), node_id, epoch, int(respect_lease), _hexes(hashes, "remove")]
        return _Call("remove", [keys.meta_key(ns)], args, lambda raw: [bool(v) for v in raw])

    def _spec_register(self, node_id: str, address: str, capacity: int, ttl_ms: int, epoch: int, extra: dict[str, str] | None) -> _Call:
        if not node_id or "|" in node_id or node_id == "_lease":
            raise InvalidInputError(f"node id {node_id!r} must be non-empty and contain no '|'")
        fields = {"address": address, "capacity": str(capacity), **(extra or {})}
        args: list[Any] = [node_id, epoch, ttl_ms]
        for k, v in fields.items():
            args += [k, v]
        key_list = [keys.NODES_ZSET, keys.node_key(node_id), keys.epoch_key(node_id)]
        return _Call("register", key_list, args, int)

    def _spec_deregister(self, node_id: str, epoch: int) -> _Call:
        return _Call("deregister", [keys.NODES_ZSET, keys.node_key(node_id)], [node_id, epoch], bool)

    def _spec_live_nodes(self) -> _Call:
        def parse(raw: list) -> list[NodeInfo]:
            nodes, pos = [], 0
            while pos < len(raw):
                node_id, pos = _text(raw[pos]), pos + 1
                fields: dict[str, str] = {}
                while _text(raw[pos]) != "":
                    fields[_text(raw[pos])] = _text(raw[pos + 1])
                    pos += 2
                pos += 1
                address, capacity, epoch = fields.pop("address"), fields.pop("capacity"), fields.pop("epoch")
                nodes.append(NodeInfo(node_id, address, int(capacity), int(epoch), fields))
            return nodes

        return _Call("live_nodes", [keys.NODES_ZSET], [keys.REGISTRY_PREFIX + "node:"], parse)


def _parse_stats(nodes: list[NodeInfo], digests: list[Any], metas: list[list[Any]]) -> IndexStats:
    spaces = []
    for digest, (raw_json, pages) in zip(digests, metas):
        ns = Namespace.model_validate_json(raw_json) if raw_json else None
        spaces.append(NamespaceStats(_text(digest), int(pages or 0), ns))
    return IndexStats(nodes, sorted(spaces, key=lambda s: s.digest))


class _IndexBase(_IndexSpecs):
    def __init__(
        self,
        url: str,
        *,
        timeout: float = 2.0,
        lease_ms: int = DEFAULT_LEASE_MS,
        reserve_ttl_ms: int = DEFAULT_RESERVE_TTL_MS,
        dead_grace_ms: int = DEFAULT_DEAD_GRACE_MS,
        password: str | None = None,
        module: Any = redis,
    ) -> None:
        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise InvalidInputError(f"Redis URL must start with redis://, rediss:// or unix://, got {redact_url(url)!r}")
        self.url = url
        self.lease_ms = lease_ms
        self.reserve_ttl_ms = reserve_ttl_ms
        self.dead_grace_ms = dead_grace_ms
        # One bounded retry keeps every call within about 2 x timeout when Redis is gone.
        # A separate password (from a Secret) overrides one in the URL.
        extra = {"password": password} if password else {}
        self._redis = module.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 1), **extra
        )
        self._scripts = {name: self._redis.register_script(src) for name, src in _SCRIPTS.items()}

    def _unavailable(self, exc: Exception) -> IndexUnavailableError:
        return IndexUnavailableError(f"Redis at {redact_url(self.url)} is unreachable: {exc}")

    def _failure(self, exc: Exception) -> KVStoreError:
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
            return self._unavailable(exc)
        return KVStoreError(f"Redis at {redact_url(self.url)} refused the request: {exc}")


class PageIndex(_IndexBase):
    """Synchronous page index (redis-py). Thread-safe: redis-py pools connections."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, module=redis, **kwargs)

    def _call(self, call: _Call) -> Any:
        try:
            raw = self._scripts[call.script](keys=call.keys, args=call.args)
        except redis.RedisError as exc:
            raise self._failure(exc) from exc
        return call.parse(raw)

    def _pipe(self, fill: Callable[[Any], None]) -> list[Any]:
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                fill(pipe)
                return pipe.execute()
        except redis.RedisError as exc:
            raise self._failure(exc) from exc

    def ping(self) -> None:
        """Raise ``IndexUnavailableError`` unless Redis answers."""
        self._pipe(lambda p: p.ping())

    def ensure_namespace(self, namespace: Namespace) -> None:
        """Record the namespace (idempotent); clients call this once at start."""
        self._pipe(lambda p: _fill_ensure(p, namespace))

    def lookup(self, namespace: Namespace | str, hashes: Sequence[bytes], lease_ms: int | None = None) -> LookupResult:
        """Longest committed live prefix of ``hashes``, with a read lease, in one command."""
        return self._call(self._spec_lookup(namespace, hashes, lease_ms))

    def reserve(self, namespace: Namespace | str, node_id: str, epoch: int, hashes: Sequence[bytes]) -> list[ReserveStatus]:
        return self._call(self._spec_reserve(namespace, node_id, epoch, hashes))

    def commit(self, namespace: Namespace | str, node_id: str, epoch: int, entries: Sequence[CommitEntry], node_ttl_ms: int) -> list[bool]:
        return self._call(self._spec_commit(namespace, node_id, epoch, entries, node_ttl_ms))

    def remove(self, namespace: Namespace | str, node_id: str, epoch: int, hashes: Sequence[bytes], respect_lease: bool = True) -> list[bool]:
        return self._call(self._spec_remove(namespace, node_id, epoch, hashes, respect_lease))

    def touch_namespaces(self, namespaces: Sequence[Namespace | str], node_id: str, epoch: int, ttl_ms: int) -> None:
        """Refresh (ttl_ms > 0) or drop (0) a node's liveness in each namespace, in one round trip."""
        self._pipe(lambda p: _fill_touch(p, namespaces, node_id, epoch, ttl_ms))

    def register_node(self, node_id: str, address: str, capacity: int, ttl_ms: int, epoch: int = 0, extra: dict[str, str] | None = None) -> int:
        """Register (epoch=0: new incarnation) or refresh a node; returns its epoch."""
        return self._call(self._spec_register(node_id, address, capacity, ttl_ms, epoch, extra))

    def deregister_node(self, node_id: str, epoch: int) -> bool:
        return self._call(self._spec_deregister(node_id, epoch))

    def live_nodes(self) -> list[NodeInfo]:
        return self._call(self._spec_live_nodes())

    def stats(self) -> IndexStats:
        nodes = self.live_nodes()
        digests = self._pipe(lambda p: p.smembers(keys.NAMESPACES_SET))[0]
        metas = self._pipe(lambda p: [p.hmget(keys.meta_key(_text(d)), "json", "pages") for d in digests])
        return _parse_stats(nodes, list(digests), metas)

    def close(self) -> None:
        self._redis.close()


class AsyncPageIndex(_IndexBase):
    """asyncio page index (redis.asyncio) with the same methods as ``PageIndex``."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, module=aioredis, **kwargs)

    async def _call(self, call: _Call) -> Any:
        try:
            raw = await self._scripts[call.script](keys=call.keys, args=call.args)
        except redis.RedisError as exc:
            raise self._failure(exc) from exc
        return call.parse(raw)

    async def _pipe(self, fill: Callable[[Any], None]) -> list[Any]:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                fill(pipe)
                return await pipe.execute()
        except redis.RedisError as exc:
            raise self._failure(exc) from exc

    async def ping(self) -> None:
        await self._pipe(lambda p: p.ping())

    async def ensure_namespace(self, namespace: Namespace) -> None:
        await self._pipe(lambda p: _fill_ensure(p, namespace))

    async def lookup(self, namespace: Namespace | str, hashes: Sequence[bytes], lease_ms: int | None = None) -> LookupResult:
        return await self._call(self._spec_lookup(namespace, hashes, lease_ms))

    async def reserve(self, namespace: Namespace | str, node_id: str, epoch: int, hashes: Sequence[bytes]) -> list[ReserveStatus]:
        return await self._call(self._spec_reserve(namespace, node_id, epoch, hashes))

    async def commit(self, namespace: Namespace | str, node_id: str, epoch: int, entries: Sequence[CommitEntry], node_ttl_ms: int) -> list[bool]:
        return await self._call(self._spec_commit(namespace, node_id, epoch, entries, node_ttl_ms))

    async def remove(self, namespace: Namespace | str, node_id: str, epoch: int, hashes: Sequence[bytes], respect_lease: bool = True) -> list[bool]:
        return await self._call(self._spec_remove(namespace, node_id, epoch, hashes, respect_lease))

    async def touch_namespaces(self, namespaces: Sequence[Namespace | str], node_id: str, epoch: int, ttl_ms: int) -> None:
        await self._pipe(lambda p: _fill_touch(p, namespaces, node_id, epoch, ttl_ms))

    async def register_node(self, node_id: str, address: str, capacity: int, ttl_ms: int, epoch: int = 0, extra: dict[str, str] | None = None) -> int:
        return await self._call(self._spec_register(node_id, address, capacity, ttl_ms, epoch, extra))

    async def deregister_node(self, node_id: str, epoch: int) -> bool:
        return await self._call(self._spec_deregister(node_id, epoch))

    async def live_nodes(self) -> list[NodeInfo]:
        return await self._call(self._spec_live_nodes())

    async def stats(self) -> IndexStats:
        nodes = await self.live_nodes()
        digests = (await self._pipe(lambda p: p.smembers(keys.NAMESPACES_SET)))[0]
        metas = await self._pipe(lambda p: [p.hmget(keys.meta_key(_text(d)), "json", "pages") for d in digests])
        return _parse_stats(nodes, list(digests), metas)

    async def close(self) -> None:
        await self._redis.aclose()


def _fill_touch(pipe: Any, namespaces: Sequence[Namespace | str], node_id: str, epoch: int, ttl_ms: int) -> None:
    # EVAL (not EVALSHA) inside a pipeline: the server caches the compiled script, and a
    # flushed script cache can never fail a heartbeat with NOSCRIPT.
    for namespace in namespaces:
        pipe.eval(_SCRIPTS["touch_alive"], 1, keys.alive_key(_ns_hex(namespace)), node_id, epoch, ttl_ms)


def _fill_ensure(pipe: Any, namespace: Namespace) -> None:
    if not isinstance(namespace, Namespace):
        raise InvalidInputError(f"ensure_namespace needs a Namespace, got {type(namespace).__name__}")
    pipe.hsetnx(keys.meta_key(namespace.digest_hex), "json", namespace.canonical_json())
    pipe.hsetnx(keys.meta_key(namespace.digest_hex), "pages", 0)
    pipe.sadd(keys.NAMESPACES_SET, namespace.digest_hex)
