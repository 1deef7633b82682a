"""The page index in Redis/Valkey: lookups, publish, eviction and the node registry.

``PageIndex`` (redis-py sync) and ``AsyncPageIndex`` (redis.asyncio) expose the same
method names. Each method is one Lua script call, so a lookup of any number of
pages is a single command on the server. Clients call ``lookup``; storage nodes
call ``commit``/``remove`` and the registry methods.

A page becomes visible only through ``commit``, which a node calls after it has
verified the page's bytes, so a failed or abandoned put never shows. Every entry
carries the node's *incarnation*, a random id drawn per registration: entries of
an incarnation that is no longer the node's registered one are invisible at once,
and an incarnation cannot repeat even if the index loses its data."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Generator, Sequence
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore import keys
from kvstore.errors import (
    FencedError,
    IndexScriptError,
    IndexUnavailableError,
    InvalidInputError,
    KVStoreError,
    NodeIdInUseError,
    UnknownNamespaceError,
)
from kvstore.hashing import HASH_BYTES
from kvstore.namespace import Namespace

DEFAULT_LEASE_MS = 5_000
# A committed entry of a node that missed heartbeats is only deleted after this grace,
# so a short stall does not wipe a healthy node's pages from the index.
DEFAULT_DEAD_GRACE_MS = 60_000
SCRIPT_NAMES = ("lookup", "commit", "remove", "touch_alive", "register", "deregister", "live_nodes")




@dataclass(frozen=True, slots=True)
class PageLocation:
    """Where one replica of a page lives: node id and incarnation, pool slot, size, checksum."""

    node_id: str
    incarnation: str
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
    incarnation: str
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    """Pages of one namespace held by live nodes (each replica counts), per node id."""

    digest: str
    pages: int
    namespace: Namespace | None
    per_node: dict[str, int] = field(default_factory=dict)


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
                        node, inc, slot, size, crc = loc.split("|")
                        replicas.append(PageLocation(node, inc, int(slot), int(size), int(crc)))
                    locations.append(replicas)
            return LookupResult(raw[0], locations)

        args = [keys.namespace_prefix(ns), _hexes(hashes, "lookup"), lease, self.dead_grace_ms]
        return _Call("lookup", [keys.meta_key(ns), keys.alive_key(ns)], args, parse)

    def _spec_commit(self, namespace: Namespace | str, node_id: str, incarnation: str, entries: Sequence[CommitEntry], node_ttl_ms: int) -> _Call:
        ns = _ns_hex(namespace)
        hexes = _hexes([e.page_hash for e in entries], "commit")
        args = [keys.namespace_prefix(ns), node_id, _inc(incarnation), node_ttl_ms, hexes]
        args += [f"{e.slot}|{e.size}|{e.checksum}" for e in entries]
        return _Call("commit", [keys.meta_key(ns), keys.alive_key(ns)], args, int)

    def _spec_remove(self, namespace: Namespace | str, node_id: str, incarnation: str, hashes: Sequence[bytes], respect_lease: bool) -> _Call:
        ns = _ns_hex(namespace)
        args = [keys.namespace_prefix(ns), node_id, _inc(incarnation), int(respect_lease), _hexes(hashes, "remove")]
        return _Call("remove", [keys.meta_key(ns)], args, lambda raw: [bool(v) for v in raw])

    def _spec_register(self, node_id: str, address: str, capacity: int, ttl_ms: int, incarnation: str | None, replaces: str, extra: dict[str, str] | None) -> _Call:
        if not node_id or "|" in node_id or node_id == "_lease" or node_id.startswith("c:"):
            raise InvalidInputError(f"node id {node_id!r} must be non-empty, contain no '|' and not start with 'c:'")
        fields = {"address": address, "capacity": str(capacity), **(extra or {})}
        # The script mints a new incarnation from its clock and these random bits, so it
        # never repeats, not even after the index lost every key (a counter would).
        args: list[Any] = [node_id, "" if incarnation is None else _inc(incarnation), ttl_ms, secrets.token_hex(8), replaces]
        for k, v in fields.items():
            args += [k, v]
        key_list = [keys.NODES_ZSET, keys.node_key(node_id), keys.incarnation_key(node_id)]

        def parse(raw: list) -> str:
            if int(raw[0]) == 1:
                return _text(raw[1])
            if _text(raw[1]) == "in_use":
                raise NodeIdInUseError(f"node id {node_id!r} is in use by a live node at {_text(raw[2])}; give every node its own --node-id")
            raise FencedError(f"incarnation {incarnation} of node {node_id!r} is no longer the registered one")

        return _Call("register", key_list, args, parse)

    def _spec_deregister(self, node_id: str, incarnation: str) -> _Call:
        return _Call("deregister", [keys.NODES_ZSET, keys.node_key(node_id)], [node_id, _inc(incarnation)], bool)

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
                address, capacity, inc = fields.pop("address"), fields.pop("capacity"), fields.pop("inc")
                nodes.append(NodeInfo(node_id, address, int(capacity), inc, fields))
            return nodes

        return _Call("live_nodes", [keys.NODES_ZSET], [keys.REGISTRY_PREFIX + "node:"], parse)


def _parse_stats(nodes: list[NodeInfo], digests: list[Any], metas: list[dict[Any, Any]]) -> IndexStats:
    """Count, per namespace, the pages of each live node's current incarnation."""
    live = {n.node_id: n.incarnation for n in nodes}
    spaces = []
    for digest, meta in zip(digests, metas):
        meta = {_text(k): _text(v) for k, v in meta.items()}
        raw_json = meta.get("json")
        ns = Namespace.model_validate_json(raw_json) if raw_json else None
        per_node: dict[str, int] = {}
        for name, value in meta.items():
            if name.startswith("c:"):
                inc, _, count = value.partition("|")
                if live.get(name[2:]) == inc:
                    per_node[name[2:]] = int(count)
        spaces.append(NamespaceStats(_text(digest), sum(per_node.values()), ns, per_node))
    return IndexStats(nodes, sorted(spaces, key=lambda s: s.digest))


def _inc(incarnation: str) -> str:
    if not isinstance(incarnation, str) or not incarnation or any(c not in "0123456789abcdef" for c in incarnation):
        raise InvalidInputError(f"incarnation must be a non-empty lowercase hex string, got {incarnation!r}")
    return incarnation


@dataclass(frozen=True, slots=True)
class _Pipe:
    """A non-transactional pipeline of plain commands; ``fill`` adds them."""

    fill: Callable[[Any], None]


class _IndexMethods(_IndexSpecs):
    """Every index method, defined once as a generator of ``_Call``/``_Pipe`` steps.

    ``_drive`` runs the steps: ``PageIndex`` returns the result, ``AsyncPageIndex``
    returns an awaitable of it. So the two flavours cannot drift apart."""

    def _drive(self, steps: Generator[Any, Any, Any]) -> Any:
        raise NotImplementedError

    def ping(self) -> Any:
        """Raise ``IndexUnavailableError`` unless Redis answers."""
        return self._drive(_one(_Pipe(lambda p: p.ping())))

    def ensure_namespace(self, namespace: Namespace) -> Any:
        """Record the namespace (idempotent): clients at start, nodes after an index loss."""
        if not isinstance(namespace, Namespace):
            raise InvalidInputError(f"ensure_namespace needs a Namespace, got {type(namespace).__name__}")
        return self._drive(_one(_Pipe(lambda p: _fill_ensure(p, namespace))))

    def server_id(self) -> Any:
        """The index server's run id; it changes whenever the server restarts, which
        tells nodes that the index may have lost or rolled back what they published."""

        def steps() -> Generator[Any, Any, str]:
            info = (yield _Pipe(lambda p: p.info("server")))[0]
            return str(info.get("run_id", ""))

        return self._drive(steps())

    def namespace(self, digest: str) -> Any:
        """The registered ``Namespace`` of a digest, or None (nodes learn namespaces here)."""

        def steps() -> Generator[Any, Any, Namespace | None]:
            raw = (yield _Pipe(lambda p: p.hget(keys.meta_key(_ns_hex(digest)), "json")))[0]
            return Namespace.model_validate_json(raw) if raw else None

        return self._drive(steps())

    def lookup(self, namespace: Namespace | str, hashes: Sequence[bytes], lease_ms: int | None = None) -> Any:
        """Longest committed live prefix of ``hashes``, with a read lease, in one command."""
        return self._drive(_one(self._spec_lookup(namespace, hashes, lease_ms)))

    def commit(self, namespace: Namespace | str, node_id: str, incarnation: str, entries: Sequence[CommitEntry], node_ttl_ms: int) -> Any:
        """Make verified pages visible; returns entries added. ``FencedError`` when the
        incarnation is superseded in this namespace."""
        return self._drive(_one(self._spec_commit(namespace, node_id, incarnation, entries, node_ttl_ms)))

    def remove(self, namespace: Namespace | str, node_id: str, incarnation: str, hashes: Sequence[bytes], respect_lease: bool = True) -> Any:
        """Drop a node's entries (eviction); per page True when its slot may be freed."""
        return self._drive(_one(self._spec_remove(namespace, node_id, incarnation, hashes, respect_lease)))

    def touch_namespaces(self, namespaces: Sequence[Namespace | str], node_id: str, incarnation: str, ttl_ms: int) -> Any:
        """Refresh (ttl_ms > 0) or drop (0) a node's liveness in each namespace, in one round trip."""
        return self._drive(_one(_Pipe(lambda p: _fill_touch(p, namespaces, node_id, incarnation, ttl_ms))))

    def register_node(self, node_id: str, address: str, capacity: int, ttl_ms: int, incarnation: str | None = None, *, replaces: str = "", extra: dict[str, str] | None = None) -> Any:
        """Register a new incarnation (``incarnation=None``; ``replaces`` names the
        caller's own previous one) or heartbeat ``incarnation``; returns the incarnation.
        Raises ``NodeIdInUseError`` when another live incarnation holds the node id and
        ``FencedError`` when a heartbeat's incarnation is no longer the registered one."""
        return self._drive(_one(self._spec_register(node_id, address, capacity, ttl_ms, incarnation, replaces, extra)))

    def deregister_node(self, node_id: str, incarnation: str) -> Any:
        return self._drive(_one(self._spec_deregister(node_id, incarnation)))

    def live_nodes(self) -> Any:
        return self._drive(_one(self._spec_live_nodes()))

    def stats(self) -> Any:
        """Live nodes and, per namespace, the pages their current incarnations hold."""

        def steps() -> Generator[Any, Any, IndexStats]:
            nodes = yield self._spec_live_nodes()
            digests = sorted(_text(d) for d in (yield _Pipe(lambda p: p.smembers(keys.NAMESPACES_SET)))[0])
            metas = yield _Pipe(lambda p: [p.hgetall(keys.meta_key(d)) for d in digests])
            return _parse_stats(nodes, digests, metas)

        return self._drive(steps())


def _one(step: Any) -> Generator[Any, Any, Any]:
    """A method of a single step: its parsed result (a pipeline's list of replies)."""
    return (yield step)


class _IndexBase(_IndexMethods):
    def __init__(
        self,
        url: str,
        *,
        timeout: float = 2.0,
        lease_ms: int = DEFAULT_LEASE_MS,
        dead_grace_ms: int = DEFAULT_DEAD_GRACE_MS,
        password: str | None = None,
        module: Any = redis,
    ) -> None:
        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise InvalidInputError(f"Redis URL must start with redis://, rediss:// or unix://, got {redact_url(url)!r}")
        self.url = url
        self.lease_ms = lease_ms
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
        if "FENCED" in str(exc):
            return FencedError(str(exc).split("FENCED", 1)[1].strip())
        if isinstance(exc, redis.ResponseError) and str(exc).startswith(("LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")):
            return self._unavailable(exc)  # a server that is starting or failing over
        return IndexScriptError(f"Redis at {redact_url(self.url)} rejected the request: {exc}")


class PageIndex(_IndexBase):
    """Synchronous page index (redis-py). Thread-safe: redis-py pools connections."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, module=redis, **kwargs)

    def _drive(self, steps: Generator[Any, Any, Any]) -> Any:
        reply = None
        try:
            while True:
                step = steps.send(reply)
                try:
                    if isinstance(step, _Pipe):
                        with self._redis.pipeline(transaction=False) as pipe:
                            step.fill(pipe)
                            reply = pipe.execute()
                    else:
                        reply = step.parse(self._scripts[step.script](keys=step.keys, args=step.args))
                except redis.RedisError as exc:
                    raise self._failure(exc) from exc
        except StopIteration as done:
            return done.value

    def close(self) -> None:
        self._redis.close()


class AsyncPageIndex(_IndexBase):
    """asyncio page index (redis.asyncio): the same methods, each returning an awaitable."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, module=aioredis, **kwargs)

    async def _drive(self, steps: Generator[Any, Any, Any]) -> Any:
        reply = None
        try:
            while True:
                step = steps.send(reply)
                try:
                    if isinstance(step, _Pipe):
                        async with self._redis.pipeline(transaction=False) as pipe:
                            step.fill(pipe)
                            reply = await pipe.execute()
                    else:
                        reply = step.parse(await self._scripts[step.script](keys=step.keys, args=step.args))
                except redis.RedisError as exc:
                    raise self._failure(exc) from exc
        except StopIteration as done:
            return done.value

    async def close(self) -> None:
        await self._redis.aclose()


def _fill_touch(pipe: Any, namespaces: Sequence[Namespace | str], node_id: str, incarnation: str, ttl_ms: int) -> None:
    # EVAL (not EVALSHA) inside a pipeline: the server caches the compiled script, and a
    # flushed script cache can never fail a heartbeat with NOSCRIPT.
    for namespace in namespaces:
        pipe.eval(_SCRIPTS["touch_alive"], 1, keys.alive_key(_ns_hex(namespace)), node_id, _inc(incarnation), ttl_ms)


def _fill_ensure(pipe: Any, namespace: Namespace) -> None:
    pipe.hsetnx(keys.meta_key(namespace.digest_hex), "json", namespace.canonical_json())
    pipe.sadd(keys.NAMESPACES_SET, namespace.digest_hex)
