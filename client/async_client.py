"""``AsyncKVCacheClient``: the store as seen by prefill and decode processes (asyncio).

Two APIs over one mechanism (publish pages, fetch a prefix of pages):
- the lookup-buffer contract of vLLM's SimpleConnector: ``insert`` / ``select``;
- a paged API for engines with paged caches: ``lookup`` / ``put_pages`` / ``get_pages``.

Remote faults (``RemoteFault``: a node that errors or times out, Redis gone, a wrong
checksum) make the affected pages count as missing, so reads return a shorter prefix
or a miss within ``timeout``. Misuse (bad shapes, dtypes, roi, options) raises
``InvalidInputError``. An index that rejects a script (a bug) is logged at ERROR,
counted in ``stats.index_script_errors`` and read as a miss."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import torch

from client import codec
from client.buffers import Span, host_bytes, page_spans, split_spans
from client.connection import NodeConnection, NodeRefusedError, OutgoingPage, SameHostUnavailableError, ShmConnection
from client.placement import place, rank_nodes
from client.stats import ClientStats
from kvstore.errors import Fault, IndexScriptError, InvalidInputError, RemoteFault
from kvstore.index import AsyncPageIndex, LookupResult, NodeInfo, PageLocation
from kvstore.index.routing import INDEX_TIMEOUT
from kvstore.pages import heads, keys
from kvstore.pages.checksum import page_checksum
from kvstore.pages.hashing import HASH_BYTES, block_hash_bytes, block_hashes, part_hashes, sequence_hash, split_hashes, token_array
from kvstore.pages.namespace import Namespace
from kvstore.settings.config import ClientOptions, client_options, client_options_from_env
from kvstore.wire import protocol as P
from kvstore.wire.shm import host_id
from kvstore.wire.transport import cuda_capable, ensure_ucx

log = logging.getLogger(__name__)
TransferMode = Literal["auto", "direct", "staged"]
# A node that failed is skipped for SUSPECT_FIRST seconds, doubling with every further
# failure up to SUSPECT_MAX, and forgiven on its first success: a node back from a
# stall serves again within about a second, one that stays dead is not hammered.
SUSPECT_FIRST = 0.5
SUSPECT_MAX = 8.0
# Staging buffers up to this size are kept for the next get (two at most).
STAGING_KEEP_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class StoredPrefix:
    """What ``find`` learnt about a prompt's stored prefix, for ``get_found``: another
    client of the same storage namespace (a TP worker of the engine whose scheduler
    looked up, in another process) fetches from it without asking the index again.
    Picklable. ``joined``: the storage chain hashes of the matched blocks, joined (an
    object per block would cost the scheduler's lookup 0.35 ms at 8,192 blocks and its
    pickling more; only workers split them); ``result``: their live replicas, every head
    group in ``units`` (first, count); ``taken``: the wall-clock time of the lookup,
    whose read lease (``lease_ms``) runs from then."""

    storage: str  # digest of the storage namespace
    block_size: int
    joined: bytes
    units: tuple[int, int]
    result: LookupResult
    taken: float
    lease_ms: int

    @property
    def blocks(self) -> int:
        """Blocks of the stored prefix."""
        return len(self.joined) // HASH_BYTES

    @property
    def tokens(self) -> int:
        """Tokens of the stored prefix (a multiple of block_size)."""
        return self.blocks * self.block_size


@dataclass(frozen=True, slots=True)
class PublishReport:
    """Outcome of a put: pages now stored (sent now or already there), sent, refused."""

    stored: int
    sent: int
    skipped: int
    refused: int
    bytes_sent: int


def split_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split constructor keywords into client options and namespace fields."""
    options = {k: v for k, v in kwargs.items() if k in ClientOptions.model_fields}
    return options, {k: v for k, v in kwargs.items() if k not in options}


class AsyncKVCacheClient:
    """Options (``ClientOptions``: replicas, timeout, transfer_mode, auth_token, ...) come
    as keywords or as ``options=``; other keywords are ``Namespace`` fields."""

    def __init__(self, redis_url: str | None = None, namespace: Namespace | None = None, *, options: ClientOptions | None = None, **kwargs: Any) -> None:
        overrides, namespace_fields = split_options(kwargs)
        if redis_url is not None:
            overrides["redis_url"] = redis_url
        opts = client_options(options, **overrides)
        if namespace is None:
            namespace = Namespace(**namespace_fields)
        elif namespace_fields:
            raise InvalidInputError(f"unknown client options {sorted(namespace_fields)} (pass either a Namespace or namespace fields)")
        self.options = opts
        self.namespace = namespace
        # pages are stored per head group, keyed by the TP-independent namespace
        # (kvstore.pages.heads): a rank reads and writes the groups its heads fall in
        self.storage = namespace.storage
        self.heads = heads.plan(namespace)
        self.replicas = opts.replicas
        self.timeout = opts.timeout
        self.transfer_mode: TransferMode = opts.transfer_mode
        self.stats = ClientStats()
        self._token = opts.auth_token.get_secret_value()
        self._progress_mode = opts.ucx_progress_mode
        self._node_refresh = opts.node_refresh
        self.index = AsyncPageIndex(
            opts.redis_url, timeout=min(opts.timeout, INDEX_TIMEOUT), lease_ms=opts.lease_ms,
            password=opts.redis_password.get_secret_value() or None,
        )
        self._ucxx: Any = None
        self._nodes: list[NodeInfo] = []
        self._nodes_at = 0.0
        self._conns: dict[str, NodeConnection | ShmConnection] = {}
        self._same_host = opts.same_host
        self._shm_failed: dict[str, str] = {}  # node id -> incarnation whose Unix socket failed
        self._suspect: dict[str, float] = {}  # node id -> skipped until (monotonic)
        self._strikes: dict[str, int] = {}  # node id -> failures since its last success
        self._namespace_registered = False
        self._staging: list[torch.Tensor] = []  # host buffers reused by staged gets (_take_staging)

    @classmethod
    def from_env(cls, namespace: Namespace | None = None, **overrides: Any) -> AsyncKVCacheClient:
        """Build from KVSTORE_* variables (see ``ClientSettings``); keyword overrides win."""
        return cls(None, namespace, options=client_options_from_env(), **overrides)

    async def start(self) -> AsyncKVCacheClient:
        """Initialise UCX and register the namespace. An unreachable index is not an
        error here: the client starts, reads miss, and the namespace is registered on
        the first call that reaches the index (an engine must not fail to boot because
        its cache is down)."""
        self._ucxx = ensure_ucx(self._progress_mode)
        await self._ensure_namespace()
        return self

    async def __aenter__(self) -> AsyncKVCacheClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for conn in self._conns.values():
            await conn.close()
        self._conns.clear()
        await self.index.close()

    # ---- paged API -------------------------------------------------------------

    async def lookup(self, token_ids: Any) -> int:
        """Tokens of ``token_ids`` covered by stored full blocks (a multiple of block_size),
        in one index round trip. Index faults count as 0."""
        return await self.lookup_checked(token_ids) or 0

    async def lookup_checked(self, token_ids: Any) -> int | None:
        """``lookup``, but None when the index could not answer at all (unreachable,
        or a script error): callers that guard the index with a circuit breaker (the
        vLLM scheduler) tell a fault from a miss with it. A shard that failed while
        others answered is a shorter prefix, not None."""
        found = await self.find(token_ids)
        return None if found is None else found.tokens

    async def find(self, token_ids: Any) -> StoredPrefix | None:
        """``lookup_checked``, keeping what the lookup found so that ``get_found`` (in
        this client or another process's) can fetch it without a second index round
        trip. None when the index could not answer at all."""
        joined = block_hash_bytes(self.storage, token_ids)
        units = (self.heads.first, self.heads.count)
        if not joined:
            result: LookupResult | None = LookupResult.empty()
        else:
            result = await self._lookup(joined)
        if result is None:
            return None
        return StoredPrefix(self.storage.digest_hex, self.storage.block_size, joined[: HASH_BYTES * result.matched], units, result, time.time(), self.index.lease_ms)

    async def put_pages(self, token_ids: Any, pages: torch.Tensor) -> PublishReport:
        """Store ``pages[i]`` (``[num_blocks, *page_shape]``) as full block i of ``token_ids``:
        as the head groups this rank holds, which engines of any TP size read. Pages a
        node already holds are not sent again; counts in the report are units (pages of
        one head group)."""
        hashes = block_hashes(self.storage, token_ids)
        self._check_pages("pages", pages, len(hashes), at_least=False)
        return await self._publish(*self._units(hashes, pages[: len(hashes)].to("cpu"), "store"))

    async def get_pages(self, token_ids: Any, out: torch.Tensor, start_block: int = 0) -> int:
        """Fill ``out[start_block:k]`` with the longest stored prefix of full blocks of
        ``token_ids`` and return k * block_size (0 when fewer than ``start_block + 1``
        blocks are stored). Blocks before ``start_block`` must be stored for the prefix to
        count but are not transferred (the caller has them). Rows past k are unspecified."""
        hashes = block_hashes(self.storage, token_ids)
        if not self._fetchable(out, len(hashes), start_block):
            return 0
        return await self._get(hashes, await self._lookup(hashes), out, start_block)

    async def get_found(self, found: StoredPrefix, out: torch.Tensor, start_block: int = 0) -> int:
        """``get_pages`` of the prefix ``found`` (by ``find``, here or in another process
        of the same storage namespace and head groups at least this rank's), without an
        index round trip while at most half its read lease has passed; past that, the
        index is asked again, as ``get_pages`` would (the lease is what keeps the pages
        from eviction). Locations that went stale in between cost a shorter prefix,
        never wrong bytes: nodes check each page's hash and checksum."""
        if found.storage != self.storage.digest_hex:
            raise InvalidInputError(f"found in storage namespace {found.storage[:12]}..., this client reads {self.storage.digest_hex[:12]}...")
        first, count = found.units
        if not (first <= self.heads.first and self.heads.first + self.heads.count <= first + count):
            raise InvalidInputError(f"found for head groups {first}..{first + count - 1}, this rank reads {self.heads.first}..{self.heads.first + self.heads.count - 1}")
        if not self._fetchable(out, found.blocks, start_block):
            return 0
        age = time.time() - found.taken
        if 0 <= age < found.lease_ms / 2000:
            result: LookupResult | None = found.result.narrow(self.heads.first - first, self.heads.count)
        else:
            self.stats.stale_finds += 1
            result = await self._lookup(found.joined)
        return await self._get(split_hashes(found.joined), result, out, start_block)

    def _fetchable(self, out: torch.Tensor, blocks: int, start_block: int) -> bool:
        """Checks a get's arguments; False when there is nothing to fetch."""
        self._check_pages("out", out, blocks, at_least=True)
        if start_block < 0:
            raise InvalidInputError(f"start_block must not be negative, got {start_block}")
        return start_block < blocks

    async def _get(self, hashes: list[bytes], result: LookupResult | None, out: torch.Tensor, start_block: int) -> int:
        """Fetch blocks ``start_block`` to ``result.matched`` of ``hashes`` into ``out``;
        the tokens of the prefix that arrived (see ``get_pages``)."""
        if not result or result.matched <= start_block:
            return 0
        n, nbytes = result.matched, self.namespace.page_nbytes
        wanted = slice(start_block, n)
        if not self.heads.identity:  # head groups land in staging and are merged into the rank's pages
            self.stats.staged_transfers += 1
            count, ns = self.heads.count, self.namespace
            staging = self._take_staging((n - start_block) * count * ns.unit_nbytes)
            units = staging[: (n - start_block) * count * ns.unit_nbytes].view(ns.torch_dtype()).view(count, n - start_block, *ns.unit_shape)
            ok = await self._fetch(*self._unit_requests(hashes, result, wanted), page_spans(host_bytes(units), (n - start_block) * count, ns.unit_nbytes))
            blocks = _whole_blocks(ok, count, n - start_block)
            if blocks:
                heads.merge(ns, units[:, :blocks], out[start_block : start_block + blocks], self.heads)
            self._give_staging(staging)  # not when cancelled: a transfer may still be landing in it
            return (start_block + blocks) * ns.block_size
        if self._mode_for(out) == "direct":
            self.stats.direct_transfers += 1
            dest = host_bytes(out) if out.device.type == "cpu" else out.reshape(-1).view(torch.uint8)
            spans = page_spans(dest, n, nbytes)[wanted]
            got = _leading(await self._fetch(*self._unit_requests(hashes, result, wanted), spans))
            return (start_block + got) * self.namespace.block_size
        self.stats.staged_transfers += 1
        staging = self._take_staging((n - start_block) * nbytes)
        got = _leading(await self._fetch(*self._unit_requests(hashes, result, wanted), page_spans(staging.numpy(), n - start_block, nbytes)))
        if got:
            flat = out.reshape(-1).view(torch.uint8)
            flat[start_block * nbytes : (start_block + got) * nbytes].copy_(staging[: got * nbytes])
        self._give_staging(staging)  # not when cancelled: a transfer may still be landing in it
        return (start_block + got) * self.namespace.block_size

    def _units(self, hashes: list[bytes], pages: torch.Tensor, verb: str) -> tuple[list[bytes], list[Span], list[bytes], list[int]]:
        """What ``put_pages`` and ``insert`` publish of this rank's host ``pages`` of blocks
        ``hashes``: its units' keys and bytes, unit by unit (``heads.split``), and each
        unit's segment anchor and position (its block's)."""
        if not self.heads.whole:
            ns = self.namespace
            raise InvalidInputError(f"this rank holds part of a head group ({ns.groups} groups of {ns.group_heads} heads for tp_size {ns.tp_size}): "
                                    f"it can read pages but not {verb} them; use head_groups of at least tp_size")
        units = pages.contiguous() if self.heads.identity else heads.split(self.namespace, pages, self.heads)
        count = self.heads.count
        anchors, positions = keys.placement(hashes)
        spans = page_spans(host_bytes(units), len(hashes) * count, self.namespace.unit_nbytes)
        return heads.unit_hashes(hashes, self.heads.first, count), spans, anchors * count, positions * count

    def _take_staging(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least ``nbytes`` (pinned where CUDA is), reused across gets:
        a fresh 64 MiB buffer costs about 20 ms of page faults here, a third of a 2 MiB-page
        get (bench/transfer.py, head groups). Only the event loop's thread calls it."""
        for i, buf in enumerate(self._staging):
            if buf.numel() >= nbytes:
                return self._staging.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def _give_staging(self, buf: torch.Tensor) -> None:
        """Keep ``buf`` for the next get, unless it is large or two are kept already:
        at most 2 x STAGING_KEEP_BYTES stay allocated between calls."""
        if buf.numel() <= STAGING_KEEP_BYTES and len(self._staging) < 2:
            self._staging.append(buf)

    # ---- lookup-buffer API (vLLM SimpleConnector contract) ----------------------

    async def insert(self, input_tokens: Any, roi: Any, key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor | None = None) -> PublishReport:
        """Store the KV of the tokens ``roi`` marks (a prefix of ``input_tokens``).

        Full blocks become shared, deduplicated pages; the trailing partial block and
        ``hidden`` go into the sequence's tail object."""
        tokens, n_all = self._roi_prefix(input_tokens, roi)
        T = len(tokens)
        ns = self.namespace
        key, value, hidden = (_token_prefix(t, T, n_all, dim) for t, dim in ((key, 1), (value, 1), (hidden, 0)))
        codec.check_kv(ns, "key", key, T)
        codec.check_kv(ns, "value", value, T)
        if hidden is not None:
            if ns.hidden_size == 0:
                raise InvalidInputError("hidden states given but the namespace has hidden_size=0")
            if tuple(hidden.shape) != (T, ns.hidden_size) or hidden.dtype != ns.torch_dtype():
                raise InvalidInputError(f"hidden must be [{T}, {ns.hidden_size}] of {ns.torch_dtype()}, got {tuple(hidden.shape)} {hidden.dtype}")
        hashes = block_hashes(self.storage, tokens)
        unit_keys, spans, anchors, positions = self._units(hashes, codec.kv_to_pages(ns, key, value), "insert")
        tail = codec.encode_tail(ns, key, value, hidden)
        part_sizes = codec.tail_part_sizes(ns, T, hidden is not None)
        # the tail (partial block, hidden states) is this rank's own: keyed by its TP
        # namespace, a chain of its own in the index
        parts = part_hashes(sequence_hash(ns, tokens, hashes), len(part_sizes))
        part_anchors, part_positions = keys.placement(parts)
        return await self._publish(unit_keys + parts, spans + split_spans(tail, part_sizes), anchors + part_anchors, positions + part_positions)

    async def select(self, input_tokens: Any, roi: Any) -> list[Any]:
        """``[input_tokens, roi, key, value, hidden]`` for the longest stored prefix of the
        tokens ``roi`` marks: everything plus ``hidden`` when this exact sequence was
        inserted, else the longest block-aligned prefix with ``hidden=None``; five
        ``None`` on a miss. The returned ``roi`` marks the matched tokens."""
        tokens, n_all = self._roi_prefix(input_tokens, roi)
        ns = self.namespace
        T = len(tokens)
        hashes = block_hashes(self.storage, tokens)
        seq = sequence_hash(ns, tokens, hashes)
        sizes_h = codec.tail_part_sizes(ns, T, ns.hidden_size > 0)
        sizes_nh = codec.tail_part_sizes(ns, T, False)
        parts = part_hashes(seq, max(len(sizes_h), len(sizes_nh)))
        result = await self._lookup(hashes + parts, breaks=[len(hashes)])
        if not result or result.matched == 0:
            return [None] * 5
        nblocks = min(result.matched, len(hashes))
        count = self.heads.count
        unit_buf = torch.empty(nblocks * count * ns.unit_nbytes, dtype=torch.uint8)
        sinks = page_spans(unit_buf.numpy(), nblocks * count, ns.unit_nbytes)
        part_sizes = [loc[0].size for loc in result.locations[nblocks:]]
        tail_buf = np.empty(sum(part_sizes), dtype=np.uint8)
        sinks += split_spans(tail_buf, part_sizes)
        unit_hashes, unit_locations = self._unit_requests(hashes, result, slice(0, nblocks))
        ok = await self._fetch(unit_hashes + parts[: result.matched - nblocks], unit_locations + result.locations[nblocks:], sinks)
        got_blocks = _whole_blocks(ok, count, nblocks)
        if got_blocks < nblocks:
            got = got_blocks  # a missing head group ends the prefix: the tail cannot follow
        else:
            got = nblocks + _leading(ok[nblocks * count :])
        units = unit_buf.view(ns.torch_dtype()).reshape(count, nblocks, *ns.unit_shape)[:, :got_blocks]
        if self.heads.identity:
            page_buf = units.reshape(-1).view(torch.uint8)
        else:
            rank_pages = torch.empty((got_blocks, *ns.page_shape), dtype=ns.torch_dtype())
            heads.merge(ns, units, rank_pages, self.heads)
            page_buf = rank_pages.reshape(-1).view(torch.uint8)
        tail = None
        if got_blocks == len(hashes) and got > nblocks:
            flags = codec.read_tail_flags(tail_buf)
            need = len(sizes_h if flags and flags[1] else sizes_nh)
            if flags and flags[0] == T and got - nblocks >= need:
                tail = codec.decode_tail(ns, tail_buf[: sum(part_sizes[:need])])
        pages = page_buf[: got_blocks * ns.page_nbytes].view(ns.torch_dtype()).reshape(got_blocks, *ns.page_shape)
        key, value = codec.pages_to_kv(pages, extra_tokens=T - got_blocks * ns.block_size if tail else 0)
        hidden, exact = None, tail is not None
        if tail is not None:
            key[:, got_blocks * ns.block_size :] = tail.partial_key
            value[:, got_blocks * ns.block_size :] = tail.partial_value
            hidden = tail.hidden
        matched = T if exact else got_blocks * ns.block_size
        if matched == 0:
            return [None] * 5
        out_roi = torch.zeros(n_all, dtype=torch.bool)
        out_roi[:matched] = True
        return [input_tokens, out_roi, key, value, hidden]

    # ---- shared mechanism --------------------------------------------------------

    async def _lookup(self, hashes: list[bytes] | bytes, breaks: Sequence[int] = ()) -> LookupResult | None:
        """The index's answer with replicas of stale incarnations dropped (an entry
        counts only while the registry names the same incarnation of its node);
        None on an index fault."""
        self.stats.lookups += 1
        if not self._namespace_registered:
            await self._ensure_namespace()
        try:
            found = await self.index.lookup(self.storage, hashes, breaks=breaks, units=(self.heads.first, self.heads.count))
        except RemoteFault as exc:
            self.stats.index_errors += 1
            log.warning("lookup failed, counting as a miss: %s", exc)
            return None
        except IndexScriptError as exc:
            self.stats.index_script_errors += 1
            log.error("the index rejected a lookup (a bug, not a fault), counting as a miss: %s", exc)
            return None
        if found.unavailable is not None:
            self.stats.index_errors += 1
            log.warning("an index shard failed, the prefix ends before its segments: %s", found.unavailable)
        return found.resolve(await self._live_nodes(include_suspect=True))

    async def _ensure_namespace(self) -> None:
        try:
            await self.index.ensure_namespace(self.storage)
            self._namespace_registered = True
        except Fault as exc:
            self._namespace_registered = False
            log.warning("cannot register the namespace (retried on the next call): %s", exc)

    async def _live_nodes(self, include_suspect: bool = False) -> list[NodeInfo]:
        """Registered nodes from a cache refreshed every ``node_refresh`` seconds; nodes
        that failed recently are left out unless ``include_suspect``."""
        now = time.monotonic()
        if now - self._nodes_at > self._node_refresh or not self._nodes:
            try:
                self._nodes = await self.index.live_nodes()
                self._nodes_at = now
            except RemoteFault as exc:
                self.stats.index_errors += 1
                log.warning("cannot list nodes: %s", exc)
        for node_id in [n for n, until in self._suspect.items() if until < now]:
            del self._suspect[node_id]
        return [n for n in self._nodes if include_suspect or n.node_id not in self._suspect]

    def _conn(self, node: NodeInfo) -> NodeConnection | ShmConnection:
        """The connection to ``node``: shared memory when it runs on this host (same
        kernel) and its Unix socket has not failed for this incarnation, else UCX."""
        conn = self._conns.get(node.node_id)
        if conn is None or conn.broken or conn.node.address != node.address or conn.node.incarnation != node.incarnation:
            same_host = self._same_host and node.extra.get("shm") and node.extra.get("host") == host_id()
            if same_host and self._shm_failed.get(node.node_id) != node.incarnation:
                conn = ShmConnection(node, self._token)
            else:
                conn = NodeConnection(node, self._token, self._ucxx)
            self._conns[node.node_id] = conn
        return conn

    async def _on_node(self, node: NodeInfo, work: Any) -> tuple[Any, NodeConnection | ShmConnection]:
        """``await work(conn)`` on the connection to ``node``. When the node's Unix socket
        cannot be reached from here (a directory not shared with this container, say),
        the same call goes over UCX, as does every later one to this incarnation: a
        healthy node must not look dead."""
        conn = self._conn(node)
        try:
            return await work(conn), conn
        except SameHostUnavailableError as exc:
            self._shm_failed[node.node_id] = node.incarnation
            log.warning("same-host path to %s unavailable, using UCX: %s", node.node_id, exc)
            conn = self._conn(node)
            return await work(conn), conn

    def _node_failed(self, node_id: str, exc: Exception) -> None:
        self.stats.node_errors += 1
        strikes = self._strikes.get(node_id, 0) + 1
        self._strikes[node_id] = strikes
        self._suspect[node_id] = time.monotonic() + min(SUSPECT_FIRST * 2 ** (strikes - 1), SUSPECT_MAX)
        self._nodes_at = 0.0  # re-read the registry on the next call
        log.warning("node %s failed, its pages count as missing: %s", node_id, exc)

    def _node_ok(self, node_id: str) -> None:
        self._strikes.pop(node_id, None)

    async def _publish(self, hashes: list[bytes], spans: list[Span], anchors: list[bytes], positions: list[int]) -> PublishReport:
        """Store each page on its ``replicas`` rendezvous nodes; a page counts as stored
        when at least one replica holds it. ``anchors`` and ``positions`` place each page
        in the index's segments (``keys.placement``; head groups of a block share their
        block's)."""
        if not self._namespace_registered:
            await self._ensure_namespace()
        nodes = {n.node_id: n for n in await self._live_nodes()}
        if not nodes or not hashes:
            self.stats.pages_refused += len(hashes)
            return PublishReport(0, 0, 0, len(hashes), 0)
        memo: dict[int, int] = {}

        def checksum(page: OutgoingPage) -> int:  # only pages some node asks for, once each
            if page.index not in memo:
                memo[page.index] = page_checksum(page.span.view())
            return memo[page.index]

        per_node: dict[str, list[int]] = defaultdict(list)
        for i, h in enumerate(hashes):
            for node_id in place(h, list(nodes), self.replicas):
                per_node[node_id].append(i)

        async def one(node_id: str, idx: list[int]) -> tuple[list[int], Any]:
            pages = [OutgoingPage(hashes[i], spans[i], i, anchors[i], positions[i]) for i in idx]
            try:
                outcome, conn = await self._on_node(nodes[node_id], lambda c: c.put(self.storage.key, pages, checksum, self.timeout))
                self._node_ok(node_id)
                if conn.path == "shm":
                    self.stats.same_host_transfers += 1
                return idx, outcome
            except NodeRefusedError as exc:
                if exc.code is not P.RefusalCode.UNKNOWN_NAMESPACE:
                    self._node_failed(node_id, exc)
                    return idx, None
                # the index lost the namespace: register it again, so the next put works
                log.warning("put refused: %s", exc)
                await self._ensure_namespace()
                return idx, None
            except RemoteFault as exc:
                self._node_failed(node_id, exc)
                return idx, None

        held, sent, skipped, nbytes = set(), 0, 0, 0
        for idx, outcome in await asyncio.gather(*(one(n, idx) for n, idx in per_node.items())):
            if outcome is None:
                continue
            held.update(idx[k] for k in outcome.stored + outcome.present)
            sent += len(outcome.stored)
            skipped += len(outcome.present)
            nbytes += outcome.bytes_sent
        refused = len(hashes) - len(held)
        self.stats.pages_sent += sent
        self.stats.pages_skipped += skipped
        self.stats.pages_refused += refused
        self.stats.bytes_sent += nbytes
        return PublishReport(len(held), sent, skipped, refused, nbytes)

    async def _fetch(self, hashes: list[bytes], locations: list[list[PageLocation]], sinks: list[Span]) -> list[bool]:
        """Fetch pages into ``sinks`` from their replicas, verify checksums, and say which
        arrived intact. Bounded by ``timeout`` overall."""
        deadline = time.monotonic() + self.timeout
        ok = [False] * len(hashes)
        tried: list[set[str]] = [set() for _ in hashes]
        nodes = {n.node_id: n for n in await self._live_nodes()}
        for _ in range(max(len(loc) for loc in locations[: len(hashes)])):
            per_node: dict[str, list[int]] = defaultdict(list)
            for i, locs in enumerate(locations[: len(hashes)]):
                if ok[i]:
                    continue
                choice = next((l for l in self._prefer(hashes[i], locs) if l.node_id not in tried[i] and l.node_id in nodes), None)
                if choice is not None:
                    tried[i].add(choice.node_id)
                    per_node[choice.node_id].append(i)
            remaining = deadline - time.monotonic()
            if not per_node or remaining <= 0:
                break

            async def one(node_id: str, idx: list[int]) -> None:
                expected = [next(l.checksum for l in locations[i] if l.node_id == node_id) for i in idx]
                try:
                    got, conn = await self._on_node(nodes[node_id], lambda c: c.get(self.storage.key, [hashes[i] for i in idx], [sinks[i] for i in idx], expected, remaining))
                except RemoteFault as exc:
                    self._node_failed(node_id, exc)
                    return
                self._node_ok(node_id)
                for k in got.ok:
                    ok[idx[k]] = True
                    self.stats.pages_received += 1
                    self.stats.bytes_received += sinks[idx[k]].nbytes
                self.stats.checksum_failures += got.corrupt
                if conn.path == "shm":
                    self.stats.same_host_transfers += 1

            await asyncio.gather(*(one(n, idx) for n, idx in per_node.items()))
            if all(ok):
                break
        return ok

    def _unit_requests(self, hashes: list[bytes], result: LookupResult, blocks: slice) -> tuple[list[bytes], list[list[PageLocation]]]:
        """The keys and replicas of this rank's head groups of ``blocks``, unit by unit
        (``heads.unit_hashes``)."""
        count, first = self.heads.count, self.heads.first
        keys_ = heads.unit_hashes(hashes[blocks], first, count)
        if count == 1:
            return keys_, result.locations[blocks]
        locations = [[loc for loc in locs if loc.unit == j] for j in range(count) for locs in result.locations[blocks]]
        return keys_, locations

    def _prefer(self, page_hash: bytes, locs: list[PageLocation]) -> list[PageLocation]:
        order = {n: r for r, n in enumerate(rank_nodes(page_hash, [l.node_id for l in locs]))}
        return sorted(locs, key=lambda l: (l.node_id in self._suspect, order[l.node_id]))

    def _mode_for(self, out: torch.Tensor) -> str:
        if out.device.type == "cpu":
            return "staged" if self.transfer_mode == "staged" else "direct"
        # Device memory cannot be mapped from a node's shared memory: with the same-host
        # path on, pages reach the device through pinned host staging.
        if self.transfer_mode == "direct":
            if not cuda_capable():
                raise InvalidInputError("transfer_mode='direct' into CUDA memory needs a UCX build with CUDA transports; use 'auto' or 'staged'")
            if self._same_host:
                raise InvalidInputError("transfer_mode='direct' into CUDA memory needs same_host=False (shared memory is host memory); use 'auto' or 'staged'")
            return "direct"
        if self.transfer_mode == "auto" and cuda_capable() and not self._same_host:
            return "direct"
        return "staged"

    def _check_pages(self, name: str, t: torch.Tensor, count: int, at_least: bool) -> None:
        ns = self.namespace
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape[1:]) != ns.page_shape:
            raise InvalidInputError(f"{name} pages have shape {tuple(t.shape[1:])}; the namespace expects {ns.page_shape} ({ns.layout})")
        if t.dtype != ns.torch_dtype():
            raise InvalidInputError(f"{name} has dtype {t.dtype}; the namespace expects {ns.torch_dtype()}")
        if (t.shape[0] < count) if at_least else (t.shape[0] != count):
            rel = "at least" if at_least else "exactly"
            raise InvalidInputError(f"{name} has {t.shape[0]} pages; {count} full blocks of tokens need {rel} {count}")
        if at_least and not t.is_contiguous():
            raise InvalidInputError(f"{name} must be contiguous so pages can be received in place")

    @staticmethod
    def _roi_prefix(input_tokens: Any, roi: Any) -> tuple[np.ndarray, int]:
        """The tokens ``roi`` marks (which must be a prefix) and the total token count."""
        tokens = token_array(input_tokens)
        mask = np.asarray(roi.detach().cpu() if hasattr(roi, "detach") else roi)
        if mask.dtype != np.bool_ or mask.shape != tokens.shape:
            raise InvalidInputError(f"roi must be a bool mask shaped like input_tokens {tokens.shape}, got {mask.dtype} {mask.shape}")
        m = int(mask.sum())
        if m == 0:
            raise InvalidInputError("roi marks no tokens")
        if not mask[:m].all():
            raise InvalidInputError("roi must mark a prefix of the tokens (True values first, then only False)")
        return tokens[:m], len(tokens)


def _leading(ok: list[bool]) -> int:
    """How many leading requests arrived intact."""
    return ok.index(False) if False in ok else len(ok)


def _whole_blocks(ok: list[bool], count: int, blocks: int) -> int:
    """How many leading blocks arrived whole: every one of their ``count`` units, which
    ``ok`` lists unit by unit (``heads.unit_hashes``)."""
    return _leading(np.array(ok[: count * blocks], dtype=bool).reshape(count, blocks).all(axis=0).tolist())


def _token_prefix(t: Any, T: int, n_all: int, dim: int) -> Any:
    """Cut a per-token tensor given for all ``n_all`` tokens down to the ``T`` that roi marks."""
    if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == n_all != T:
        return t.narrow(dim, 0, T)
    return t
