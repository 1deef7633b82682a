"""``AsyncKVCacheClient``: the store as seen by prefill and decode processes (asyncio).

Two APIs over one mechanism (publish pages, fetch a prefix of pages):
- a paged API for engines with paged caches: ``lookup`` / ``put_pages`` / ``get_pages``
  (and ``find`` / ``get_found``), here;
- the lookup-buffer contract of vLLM's SimpleConnector: ``insert`` / ``select``, in
  ``client.sequences``.

Nodes (registry, suspicion, connections) are ``client.nodes.NodeDirectory``; host
host buffers ``client.staging.HostBuffers`` (one pool per process).

Remote faults (``RemoteFault``: a node that errors or times out, Redis gone, a wrong
checksum) make the affected pages count as missing, so reads return a shorter prefix
or a miss within ``timeout``. Misuse (bad shapes, dtypes, roi, options) raises
``InvalidInputError``; a put or get that every node asked refused for the client's
credentials raises ``CredentialError`` (a ``PermissionError``). An index that rejects a script (a bug) is logged at ERROR,
counted in ``stats.index_script_errors`` and read as a miss."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch

from client.buffers import Span, host_bytes, page_spans
from client.connection import NodeRefusedError, OutgoingPage
from client.nodes import NodeDirectory
from client.placement import place
from client.sequences import LookupBufferAPI, leading, whole_blocks
from client.staging import host_buffers
from client.stats import ClientStats
from kvstore.errors import CredentialError, Fault, IndexScriptError, InvalidInputError, KVStoreError, RemoteFault
from kvstore.index import AsyncPageIndex, LookupResult, NodeInfo, PageLocation
from kvstore.index.routing import INDEX_TIMEOUT
from kvstore.pages import heads, keys
from kvstore.pages.checksum import HashAhead, checksums, start_helper
from kvstore.pages.hashing import HASH_BYTES, block_hash_bytes, split_hashes
from kvstore.pages.identity import BlockExtras, RequestIdentity, resolve
from kvstore.pages.namespace import Namespace
from kvstore.settings.config import ClientOptions, client_options, client_options_from_env
from kvstore.wire import protocol as P
from kvstore.wire.transport import ensure_ucx

log = logging.getLogger(__name__)
# Longest a client's start waits for its connections to the live nodes (the rest
# finish in the background, before or during the first request to each node).
START_CONNECT_WAIT_S = 1.0
# Most a UCX put hashes ahead while its plan is on its way (``_ChecksumOnce.ahead``):
# about 5 ms of the helper thread, the longest a same-host copy of this client can
# wait behind it for its half of the work, and the most hashed in vain when the
# node holds the pages already.
HASH_AHEAD_BYTES = 64 << 20
TransferMode = Literal["auto", "direct", "staged"]
# What a call's ``identity`` may be: a request identity, one already resolved to blocks
# (the vLLM connector's workers get those), or None for a plain request.
Identity = RequestIdentity | BlockExtras | None
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


class AsyncKVCacheClient(LookupBufferAPI):
    """Options (``ClientOptions``: replicas, timeout, transfer_mode, auth_token, ...) come
    as keywords or as ``options=``; other keywords are ``Namespace`` fields. Without
    ``options=``, every option not passed as a keyword is read from its ``KVSTORE_*``
    variable (``ClientSettings``), else its default: a shell that exported what
    ``kvstore up`` prints (the index URL and the token file) needs no other option,
    and a missing token cannot be a silent miss (``CredentialError``)."""

    def __init__(self, redis_url: str | None = None, namespace: Namespace | None = None, *, options: ClientOptions | None = None, **kwargs: Any) -> None:
        overrides, namespace_fields = split_options(kwargs)
        if redis_url is not None:
            overrides["redis_url"] = redis_url
        opts = client_options(options if options is not None else client_options_from_env(), **overrides)
        if namespace is None:
            namespace = Namespace(**namespace_fields)
        elif namespace_fields:
            raise InvalidInputError(f"unknown client options {sorted(namespace_fields)} (pass either a Namespace or namespace fields)")
        if opts.weights_revision and opts.weights_revision != namespace.weights:
            if namespace.weights:
                raise InvalidInputError(f"weights_revision {opts.weights_revision!r} contradicts the namespace's weights {namespace.weights!r}")
            namespace = namespace.model_copy(update={"weights": opts.weights_revision})
        self.options = opts
        self.namespace = namespace
        # pages are stored per head group, keyed by the TP-independent namespace
        # (kvstore.pages.heads): a rank reads and writes the groups its heads fall in
        self.storage = namespace.storage
        self.heads = heads.rank_units(namespace)
        self.replicas = opts.replicas
        self.timeout = opts.timeout
        self.transfer_mode: TransferMode = opts.transfer_mode
        self.stats = ClientStats()
        self._progress_mode = opts.ucx_progress_mode
        self.index = AsyncPageIndex(
            opts.redis_url, timeout=min(opts.timeout, INDEX_TIMEOUT), lease_ms=opts.lease_ms,
            password=opts.redis_password.get_secret_value() or None,
        )
        self.nodes = NodeDirectory(self.index, self.stats, token=opts.auth_token.get_secret_value(), same_host=opts.same_host, refresh=opts.node_refresh)
        self._namespace_registered = False
        self.namespace_error: str | None = None  # why the last registration of the namespace failed
        self._buffers = host_buffers()
        self._connecting: asyncio.Future | None = None  # start's connections and probes (``NodeDirectory.connect``)

    @classmethod
    def from_env(cls, namespace: Namespace | None = None, **overrides: Any) -> AsyncKVCacheClient:
        """Build from KVSTORE_* variables (see ``ClientSettings``); keyword overrides win.
        The same as the constructor without ``options=``; kept for callers that say so."""
        return cls(None, namespace, options=client_options_from_env(), **overrides)

    async def start(self) -> AsyncKVCacheClient:
        """Initialise UCX, fault in the process's host buffers, register the namespace
        and connect to the live nodes (waiting at most ``START_CONNECT_WAIT_S``), so
        that the first request pays none of it. An
        unreachable index or node is not an error here: the client starts, reads miss,
        and the namespace is registered on the first call that reaches the index (an
        engine must not fail to boot because its cache is down)."""
        self.nodes.ucxx = ensure_ucx(self._progress_mode)
        # warmed here, not inside the first request (a fresh buffer costs its page faults)
        await asyncio.get_running_loop().run_in_executor(None, self._buffers.reserve, self.options.host_buffer_bytes)
        start_helper()
        await self._ensure_namespace()
        # waited for up to a second, then left to finish in the background: a node slow
        # to answer must not hold up an engine's start for the client timeout
        self._connecting = asyncio.ensure_future(self.nodes.connect(self.timeout, self.storage.key))
        await asyncio.wait({self._connecting}, timeout=min(self.timeout, START_CONNECT_WAIT_S))
        return self

    async def __aenter__(self) -> AsyncKVCacheClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
        await self.nodes.close()
        await self.index.close()

    # ---- paged API -------------------------------------------------------------

    def chain_hashes(self, token_ids: Any, identity: Identity = None) -> bytes:
        """The storage chain hashes of ``token_ids``' full blocks, joined, under
        ``identity`` (``kvstore.pages.identity``: the adapter, salt, multimodal items and
        prompt embeddings the KV depends on; None for a plain request). Every paged and
        lookup-buffer call keys its pages with it."""
        return block_hash_bytes(self.storage, token_ids, resolve(identity, self.storage.block_size, len(token_ids)))

    async def lookup(self, token_ids: Any, *, identity: Identity = None) -> int:
        """Tokens of ``token_ids`` covered by stored full blocks (a multiple of block_size),
        in one index round trip. Index faults count as 0. ``identity``: what else the
        request's KV depends on (``RequestIdentity``); pages stored under another
        identity never match."""
        return await self.lookup_checked(token_ids, identity=identity) or 0

    async def lookup_checked(self, token_ids: Any, *, identity: Identity = None) -> int | None:
        """``lookup``, but None when the index could not answer at all (unreachable,
        or a script error): callers that guard the index with a circuit breaker (the
        vLLM scheduler) tell a fault from a miss with it. A shard that failed while
        others answered is a shorter prefix, not None."""
        found = await self.find(token_ids, identity=identity)
        return None if found is None else found.tokens

    async def find(self, token_ids: Any, *, identity: Identity = None) -> StoredPrefix | None:
        """``lookup_checked``, keeping what the lookup found so that ``get_found`` (in
        this client or another process's) can fetch it without a second index round
        trip. None when the index could not answer at all."""
        joined = self.chain_hashes(token_ids, identity)
        result = await self._lookup(joined) if joined else LookupResult.empty()
        return None if result is None else self.stored_prefix(joined, result)

    def stored_prefix(self, joined: bytes, result: LookupResult) -> StoredPrefix:
        """What ``find`` returns for the lookup of ``joined`` that gave ``result``."""
        units = (self.heads.first, self.heads.count)
        return StoredPrefix(self.storage.digest_hex, self.storage.block_size, joined[: HASH_BYTES * result.matched], units, result, time.time(), self.index.lease_ms)

    async def put_pages(self, token_ids: Any, pages: torch.Tensor, *, identity: Identity = None) -> PublishReport:
        """Store ``pages[i]`` (``[num_blocks, *page_shape]``) as full block i of ``token_ids``:
        as the head groups this rank holds, which engines of any TP size read. Pages a
        node already holds are not sent again; counts in the report are units (pages of
        one head group). ``identity``: as for ``lookup``."""
        hashes = split_hashes(self.chain_hashes(token_ids, identity))
        self._check_pages("pages", pages, len(hashes), at_least=False)
        return await self._publish(*self._units(hashes, pages[: len(hashes)].to("cpu"), "store"))

    async def get_pages(self, token_ids: Any, out: torch.Tensor, start_block: int = 0, *, identity: Identity = None) -> int:
        """Fill ``out[start_block:k]`` with the longest stored prefix of full blocks of
        ``token_ids`` and return k * block_size (0 when fewer than ``start_block + 1``
        blocks are stored). Blocks before ``start_block`` must be stored for the prefix to
        count but are not transferred (the caller has them). Rows past k are unspecified.
        ``identity``: as for ``lookup``."""
        hashes = split_hashes(self.chain_hashes(token_ids, identity))
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
        self._check_found(found)
        if not self._fetchable(out, found.blocks, start_block):
            return 0
        return await self._get(split_hashes(found.joined), await self._found_result(found), out, start_block)

    async def get_found_units(self, found: StoredPrefix, buf: torch.Tensor, start_block: int = 0) -> tuple[torch.Tensor, int]:
        """``get_found`` for a caller that places this rank's head-group units itself (the
        vLLM connector writes them straight into its paged cache: one host copy fewer
        than ``get_found``'s merge into rank pages, and no staging buffer of the
        client's). Fetches into ``buf`` (a contiguous host tensor of at least
        ``units_nbytes(found.blocks - start_block)`` bytes) and returns the units of
        blocks ``start_block`` on, ``[count, m, *unit_shape]`` (a view of ``buf``), and how
        many of those blocks arrived whole (``heads.rank_parts`` cuts them)."""
        self._check_found(found)
        ns, count = self.namespace, self.heads.count
        if start_block < 0:
            raise InvalidInputError(f"start_block must not be negative, got {start_block}")
        m = found.blocks - start_block
        flat = host_bytes(buf) if m > 0 else None
        if m > 0 and flat.size < self.units_nbytes(m):
            raise InvalidInputError(f"buf holds {flat.size} bytes; {m} blocks of {count} units need {self.units_nbytes(m)}")
        result = await self._found_result(found) if m > 0 else None
        if not result or result.matched <= start_block:
            return torch.empty((count, 0, *ns.unit_shape), dtype=ns.torch_dtype()), 0
        return await self._fetch_units(split_hashes(found.joined), result, start_block, torch.from_numpy(flat))

    async def get_found_into(self, found: StoredPrefix, sinks: list[Span], start_block: int = 0) -> int:
        """``get_found`` into ``sinks``, one per block from ``start_block`` on (at least
        ``found.blocks - start_block`` of them): pages scattered over the caller's memory
        (the vLLM connector's ``PagedCache.block_spans``: the cache's own blocks), so
        the node's slot is copied straight there on the same host, and through one
        scratch copy over UCX. Every page is verified by checksum; a block that did not
        arrive intact ends the prefix, and the bytes of the blocks past it are
        unspecified. For a rank whose head groups are its whole pages
        (``heads.identity``)."""
        self._check_found(found)
        if not self.heads.identity:
            raise InvalidInputError("get_found_into needs a rank whose pages are whole head-group units; use get_found_units")
        if start_block < 0:
            raise InvalidInputError(f"start_block must not be negative, got {start_block}")
        if len(sinks) < found.blocks - start_block:
            raise InvalidInputError(f"{len(sinks)} sinks for {found.blocks - start_block} blocks")
        if any(s.nbytes != self.namespace.page_nbytes for s in sinks):
            raise InvalidInputError(f"every sink must hold one page of {self.namespace.page_nbytes} bytes")
        result = await self._found_result(found) if found.blocks > start_block else None
        if not result or result.matched <= start_block:
            return 0
        return await self._fetch_into(split_hashes(found.joined), result, start_block, sinks[: result.matched - start_block])

    def units_nbytes(self, blocks: int) -> int:
        """Bytes of this rank's head-group units of ``blocks`` blocks."""
        return blocks * self.heads.count * self.namespace.unit_nbytes

    def _check_found(self, found: StoredPrefix) -> None:
        if found.storage != self.storage.digest_hex:
            raise InvalidInputError(f"found in storage namespace {found.storage[:12]}..., this client reads {self.storage.digest_hex[:12]}...")
        first, count = found.units
        if not (first <= self.heads.first and self.heads.first + self.heads.count <= first + count):
            raise InvalidInputError(f"found for head groups {first}..{first + count - 1}, this rank reads {self.heads.first}..{self.heads.first + self.heads.count - 1}")

    async def _found_result(self, found: StoredPrefix) -> LookupResult | None:
        """``found``'s replicas of this rank's head groups while at most half its read
        lease has passed; else the index is asked again."""
        age = time.time() - found.taken
        if 0 <= age < found.lease_ms / 2000:
            return found.result.narrow(self.heads.first - found.units[0], self.heads.count)
        self.stats.stale_finds += 1
        return await self._lookup(found.joined)

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
            staging = torch.from_numpy(self._buffers.take(self.units_nbytes(n - start_block)))
            units, blocks = await self._fetch_units(hashes, result, start_block, staging)
            if blocks:
                heads.merge(self.namespace, units[:, :blocks], out[start_block : start_block + blocks], self.heads)
            self._buffers.give(staging)  # not when cancelled: a transfer may still be landing in it
            return (start_block + blocks) * self.namespace.block_size
        if self._mode_for(out) == "direct":
            self.stats.direct_transfers += 1
            dest = host_bytes(out) if out.device.type == "cpu" else out.reshape(-1).view(torch.uint8)
            return await self._fetch_into(hashes, result, start_block, page_spans(dest, n, nbytes)[wanted])
        self.stats.staged_transfers += 1
        staging = torch.from_numpy(self._buffers.take((n - start_block) * nbytes))
        got = leading(await self._fetch(*self._unit_requests(hashes, result, wanted), page_spans(staging.numpy(), n - start_block, nbytes)))
        if got:
            flat = out.reshape(-1).view(torch.uint8)
            flat[start_block * nbytes : (start_block + got) * nbytes].copy_(staging[: got * nbytes])
        self._buffers.give(staging)  # not when cancelled: a transfer may still be landing in it
        return (start_block + got) * self.namespace.block_size

    async def _fetch_into(self, hashes: list[bytes], result: LookupResult, start_block: int, spans: list[Span]) -> int:
        """Fetch whole pages of blocks ``start_block`` to ``result.matched`` into ``spans``
        (one per block); the tokens of the prefix that arrived."""
        got = leading(await self._fetch(*self._unit_requests(hashes, result, slice(start_block, result.matched)), spans))
        return (start_block + got) * self.namespace.block_size

    async def _fetch_units(self, hashes: list[bytes], result: LookupResult, start_block: int, buf: torch.Tensor,
                           end: int | None = None) -> tuple[torch.Tensor, int]:
        """Fetch this rank's units of blocks ``start_block`` to ``end`` (``result.matched``
        when None) into the uint8 host tensor ``buf``: the units ``[count, m, *unit_shape]``
        and how many leading blocks arrived whole."""
        end = result.matched if end is None else end
        ns, count, m = self.namespace, self.heads.count, end - start_block
        units = buf[: self.units_nbytes(m)].view(ns.torch_dtype()).view(count, m, *ns.unit_shape)
        ok = await self._fetch(*self._unit_requests(hashes, result, slice(start_block, end)), page_spans(host_bytes(units), m * count, ns.unit_nbytes))
        return units, whole_blocks(ok, count, m)

    def _units(self, hashes: list[bytes], pages: torch.Tensor, verb: str) -> tuple[list[bytes], list[Span], list[bytes], list[int]]:
        """What ``put_pages`` publishes of this rank's host ``pages`` of blocks ``hashes``:
        its units' keys and bytes, unit by unit (``heads.split``), and each unit's
        segment anchor and position (``_unit_keys``)."""
        unit_keys, anchors, positions = self._unit_keys(hashes, verb)
        units = pages.contiguous() if self.heads.identity else heads.split(self.namespace, pages, self.heads)
        spans = page_spans(host_bytes(units), len(hashes) * self.heads.count, self.namespace.unit_nbytes)
        return unit_keys, spans, anchors, positions

    def _unit_keys(self, hashes: list[bytes], verb: str) -> tuple[list[bytes], list[bytes], list[int]]:
        """The keys of this rank's units of blocks ``hashes``, unit by unit, and each
        unit's segment anchor and position (its block's). Raises unless the rank holds
        whole head groups: only those can be stored (``put_pages``, ``insert``)."""
        if not self.heads.whole:
            ns = self.namespace
            raise InvalidInputError(f"this rank holds part of a head group ({ns.groups} groups of {ns.group_heads} heads for tp_size {ns.tp_size}): "
                                    f"it can read pages but not {verb} them; use head_groups of at least tp_size")
        count = self.heads.count
        anchors, positions = keys.placement(hashes)
        return heads.unit_hashes(hashes, self.heads.first, count), anchors * count, positions * count

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
        except (RemoteFault, IndexScriptError) as exc:
            return self.lookup_failed(exc)
        return self.resolve_lookup(found, await self.nodes.live(include_suspect=True))

    @property
    def namespace_registered(self) -> bool:
        return self._namespace_registered

    def lookup_failed(self, exc: KVStoreError) -> None:
        """A lookup the index could not answer: counted and logged, a miss (None)."""
        if isinstance(exc, IndexScriptError):
            self.stats.index_script_errors += 1
            log.error("the index rejected a lookup (a bug, not a fault), counting as a miss: %s", exc)
        else:
            self.stats.index_errors += 1
            log.warning("lookup failed, counting as a miss: %s", exc)
        return None

    def resolve_lookup(self, found: Any, nodes: list[NodeInfo]) -> LookupResult | None:
        """The index's answer with replicas of stale incarnations dropped (an entry
        counts only while the registry names the same incarnation of its node). A shard
        that failed after the first segment shortens the prefix; one that failed on the
        first (a single index that cannot be reached: nothing was answered) is a fault,
        None, as an index that raised: the vLLM scheduler counts it and its circuit
        breaker opens on it."""
        if found.unavailable is not None:
            if found.covered == 0:
                return self.lookup_failed(found.unavailable)
            self.stats.index_errors += 1
            log.warning("an index shard failed, the prefix ends before its segments: %s", found.unavailable)
        return found.resolve(nodes)

    async def _ensure_namespace(self) -> None:
        try:
            await self.index.ensure_namespace(self.storage)
            self._namespace_registered = True
        except Fault as exc:
            self._namespace_registered = False
            self.namespace_error = str(exc)
            log.warning("cannot register the namespace (retried on the next call): %s", exc)

    async def _publish(self, hashes: list[bytes], spans: list[Span], anchors: list[bytes], positions: list[int]) -> PublishReport:
        """Store each page on its ``replicas`` rendezvous nodes; a page counts as stored
        when at least one replica holds it. ``anchors`` and ``positions`` place each page
        in the index's segments (``keys.placement``; head groups of a block share their
        block's)."""
        if not self._namespace_registered:
            await self._ensure_namespace()
        nodes = {n.node_id: n for n in await self.nodes.live()}
        if not nodes or not hashes:
            self.stats.pages_refused += len(hashes)
            return PublishReport(0, 0, 0, len(hashes), 0)
        pages = [OutgoingPage(h, spans[i], i, anchors[i], positions[i]) for i, h in enumerate(hashes)]
        checksum = _ChecksumOnce()
        per_node: dict[str, list[int]] = defaultdict(list)
        for i, h in enumerate(hashes):
            for node_id in place(h, list(nodes), self.replicas):
                per_node[node_id].append(i)
        refusals: list[NodeRefusedError] = []
        outcomes = await asyncio.gather(*(self._put_on(nodes[n], [pages[i] for i in idx], checksum, refusals) for n, idx in per_node.items()))
        self._raise_if_all_refused(refusals, set(per_node), "store")
        return self._tally(len(hashes), zip(per_node.values(), outcomes))

    async def _put_on(self, node: NodeInfo, pages: list[OutgoingPage], checksum: Any, refusals: list[NodeRefusedError]) -> Any:
        """Put ``pages`` on ``node``; the node's outcome, or None when it failed or
        refused (a node that lost the namespace gets it registered again; one that
        refused the client's token goes into ``refusals``)."""
        try:
            outcome, conn = await self.nodes.on_node(node, lambda c: c.put(self.storage.key, pages, checksum, self.timeout))
        except NodeRefusedError as exc:
            if exc.credentials:
                self._credential_refusal(exc, refusals)
                return None
            if exc.code is not P.RefusalCode.UNKNOWN_NAMESPACE:
                self.nodes.failed(node.node_id, exc)
                return None
            # the index lost the namespace: register it again, so the next put works
            log.warning("put refused: %s", exc)
            await self._ensure_namespace()
            return None
        except RemoteFault as exc:
            self.nodes.failed(node.node_id, exc)
            return None
        self.nodes.ok(node.node_id)
        if conn.path == "shm":
            self.stats.same_host_transfers += 1
        return outcome

    def _credential_refusal(self, exc: NodeRefusedError, refusals: list[NodeRefusedError]) -> None:
        """A node refused this client's token: the node is healthy (not suspected), the
        client is misconfigured; the call raises if every node it asked did."""
        self.stats.credential_refusals += 1
        refusals.append(exc)
        log.warning("%s", exc)

    def _raise_if_all_refused(self, refusals: list[NodeRefusedError], asked: set[str], verb: str) -> None:
        """Raise ``CredentialError`` when every node in ``asked`` refused the client's
        token; a node that failed otherwise (down, stalled) keeps the call a miss."""
        if not refusals or {r.node_id for r in refusals} != asked:
            return
        tenant = self.namespace.tenant
        right = "read/write" if verb == "store" else "read"
        why = "; ".join(f"{r.node_id}: {r.code.value}: {r.message}" for r in refusals)
        raise CredentialError(
            f"every node asked refused to {verb} pages of tenant {tenant!r} for this client's credentials ({why}). "
            f"Pass the data-plane token the nodes accept, with {right} rights on tenant {tenant!r}: auth_token=... to the client, "
            f"or KVSTORE_AUTH_TOKEN / KVSTORE_AUTH_TOKEN_FILE in the environment (read by the constructor for options not passed); "
            f"`kvstore up` prints KVSTORE_AUTH_TOKEN_FILE=..., a tenant's token comes from the nodes' --credentials-file (docs/security.md)",
            node_ids=sorted(asked), tenant=tenant, operation=verb)

    def _tally(self, total: int, outcomes: Any) -> PublishReport:
        """A put's report from each node's outcome (``(indexes, outcome)`` pairs); a page
        counts as stored when at least one replica holds it."""
        held, sent, skipped, nbytes = set(), 0, 0, 0
        for idx, outcome in outcomes:
            if outcome is None:
                continue
            held.update(idx[k] for k in outcome.stored + outcome.present)
            sent += len(outcome.stored)
            skipped += len(outcome.present)
            nbytes += outcome.bytes_sent
        refused = total - len(held)
        self.stats.pages_sent += sent
        self.stats.pages_skipped += skipped
        self.stats.pages_refused += refused
        self.stats.bytes_sent += nbytes
        return PublishReport(len(held), sent, skipped, refused, nbytes)

    async def _fetch(self, hashes: list[bytes], locations: list[list[PageLocation]], sinks: list[Span]) -> list[bool]:
        """Fetch pages into ``sinks`` from their replicas, verify checksums, and say which
        arrived intact. Bounded by ``timeout`` overall: each round asks every page's next
        untried replica, all nodes at once."""
        deadline = time.monotonic() + self.timeout
        ok = [False] * len(hashes)
        tried: list[set[str]] = [set() for _ in hashes]
        nodes = {n.node_id: n for n in await self.nodes.live()}
        asked: set[str] = set()
        refusals: list[NodeRefusedError] = []
        for _ in range(max(len(loc) for loc in locations[: len(hashes)])):
            per_node = self._next_round(hashes, locations, ok, tried, nodes)
            remaining = deadline - time.monotonic()
            if not per_node or remaining <= 0:
                break
            asked.update(per_node)
            await asyncio.gather(*(self._get_on(nodes[n], idx, hashes, locations, sinks, ok, remaining, refusals) for n, idx in per_node.items()))
            if all(ok):
                break
        self._raise_if_all_refused(refusals, asked, "read")
        return ok

    def _next_round(self, hashes: list[bytes], locations: list[list[PageLocation]], ok: list[bool], tried: list[set[str]],
                    nodes: dict[str, NodeInfo]) -> dict[str, list[int]]:
        """Per node, the pages still missing whose preferred untried replica it holds."""
        per_node: dict[str, list[int]] = defaultdict(list)
        for i, locs in enumerate(locations[: len(hashes)]):
            if ok[i]:
                continue
            choice = next((l for l in self.nodes.prefer(hashes[i], locs) if l.node_id not in tried[i] and l.node_id in nodes), None)
            if choice is not None:
                tried[i].add(choice.node_id)
                per_node[choice.node_id].append(i)
        return per_node

    async def _get_on(self, node: NodeInfo, idx: list[int], hashes: list[bytes], locations: list[list[PageLocation]], sinks: list[Span],
                      ok: list[bool], seconds: float, refusals: list[NodeRefusedError]) -> None:
        """Get pages ``idx`` from ``node`` into their sinks, marking in ``ok`` those that
        arrived intact; a node that fails is suspected, its pages stay missing (one
        that refused the client's token goes into ``refusals``)."""
        expected = [next(l.checksum for l in locations[i] if l.node_id == node.node_id) for i in idx]
        try:
            got, conn = await self.nodes.on_node(node, lambda c: c.get(self.storage.key, [hashes[i] for i in idx], [sinks[i] for i in idx], expected, seconds))
        except NodeRefusedError as exc:
            if exc.credentials:
                self._credential_refusal(exc, refusals)
            else:
                self.nodes.failed(node.node_id, exc)
            return
        except RemoteFault as exc:
            self.nodes.failed(node.node_id, exc)
            return
        self.nodes.ok(node.node_id)
        for k in got.ok:
            ok[idx[k]] = True
            self.stats.pages_received += 1
            self.stats.bytes_received += sinks[idx[k]].nbytes
        self.stats.checksum_failures += got.corrupt
        if conn.path == "shm":
            self.stats.same_host_transfers += 1

    def _unit_requests(self, hashes: list[bytes], result: LookupResult, blocks: slice) -> tuple[list[bytes], list[list[PageLocation]]]:
        """The keys and replicas of this rank's head groups of ``blocks``, unit by unit
        (``heads.unit_hashes``)."""
        count, first = self.heads.count, self.heads.first
        keys_ = heads.unit_hashes(hashes[blocks], first, count)
        if count == 1:
            return keys_, result.locations[blocks]
        locations = [[loc for loc in locs if loc.unit == j] for j in range(count) for locs in result.locations[blocks]]
        return keys_, locations

    def _mode_for(self, out: torch.Tensor) -> str:
        if out.device.type == "cpu":
            return "staged" if self.transfer_mode == "staged" else "direct"
        # Device memory is reached through pinned host staging: every page is checked
        # against its checksum as it lands, and the check reads host memory. A receive
        # straight into device memory (UCX's cuda_copy) raised in that check, so each
        # such get counted a healthy node as failed and missed; 'auto' picked it on every
        # CUDA-capable UCX build without the same-host path (found reading the GPU
        # check's code paths, bench/gpu_check.py; no GPU was lent to measure it).
        if self.transfer_mode == "direct":
            raise InvalidInputError(f"transfer_mode='direct' into {out.device.type} memory is not offered: a page received there cannot be "
                                    "checked against its checksum; use 'auto' or 'staged' (pinned host memory, checked, then one copy to the device)")
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


class _ChecksumOnce:
    """A put's page checksums, each computed once and, beyond what ``ahead`` hashes
    while a plan is on its way, only for pages some node asks for (a node that already
    holds a page makes the client hash it only if it was hashed ahead)."""

    def __init__(self) -> None:
        self._memo: dict[int, int] = {}  # written by the helper thread too (one key per page)

    def of(self, pages: list[OutgoingPage]) -> list[int]:
        """The pages' checksums, the missing ones computed on two threads."""
        missing = [p for p in pages if p.index not in self._memo]
        for page, digest in zip(missing, checksums([p.span.view() for p in missing])):
            self._memo.setdefault(page.index, digest)
        return [self._memo[p.index] for p in pages]

    def ahead(self, pages: list[OutgoingPage]) -> HashAhead:
        """Start hashing ``pages`` (those in one piece, not hashed yet, up to
        ``HASH_AHEAD_BYTES``) on the helper thread; ``stop`` it when the plan is in."""
        todo, nbytes = [], 0
        for page in pages:
            if page.index in self._memo or page.span.pieces:
                continue
            if nbytes + page.span.nbytes > HASH_AHEAD_BYTES:
                break
            todo.append(page)
            nbytes += page.span.nbytes
        return HashAhead([p.span.view() for p in todo], lambda k, digest: self._memo.setdefault(todo[k].index, digest))

    def record(self, page: OutgoingPage, digest: int) -> None:
        """A checksum computed while the page was packed (UCX puts of scattered pages)."""
        self._memo.setdefault(page.index, digest)
