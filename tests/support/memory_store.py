"""A store in this process's memory that keeps real page bytes and answers lookups by
the same rules as the index and nodes: ``MemoryStore`` (the pages) and
``MemoryStore.client(namespace)`` (a ``client.vllm.store.PrefixStore`` and
``PageStore`` of one namespace, as ``KVCacheClient`` is both).

Not a mock: a page is kept under its namespace's storage digest and its chained block
hash (``kvstore.pages.hashing.block_hash_bytes`` over ``namespace.storage``, the
request identity resolved to blocks as ``PrefixLookup.chain_hashes`` resolves it: LoRA,
salt, weights revision, multimodal items, embeddings), so a prompt finds what an engine
of the same namespace and identity stored, and nothing else. ``find`` answers with the
longest stored prefix of full blocks (``last``: the prefix up to the last block stored,
gaps allowed, holding that block alone, as ``IndexLookup.resolve``), as a
``StoredPrefix`` built as ``PrefixLookup.stored_prefix`` builds it, its replicas on
one "node" (this store). An index that cannot answer is ``down``; one slower than the
caller's timeout (``latency``, compared, not slept) is a None too, as the real
client's lookup past its budget.

Gets run by plan (``read``, as ``KVCacheClient.read``): the pages a plan names land,
as real bytes, where its destination says (host pages, spans of the caller's memory,
"device" rows with the host as the device, layer by layer with a feed), and the
prefix ends at the first page missing (evicted since the lookup: ``evict_on_read``),
as a node's get ends at the first page that did not arrive whole. Puts store the bytes
of a worker's pages under the same hashes. Head-group units (a TP rank's share of
another rank's pages) are not served. A keyed layout's pages (SGLang's HiCache keys)
are found, fetched and stored by the keyed calls (``tests/support/memory_keyed.py``).

For tests only (tests/vllm/test_scheduler_decisions.py, test_worker_decisions.py,
through tests/support/connector_harness.py): the connector's scheduler and its real
worker, both opening their stores here (``KVStoreConnector``'s ``stores``); SGLang's
HiCache backend in tests/support/sglang_memory_checks.py (``KVStoreHiCache``'s
``stores``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from client.gets.plan import (
    GetPlan,
    IntoDevice,
    IntoLayers,
    IntoPages,
    IntoSpans,
    IntoUnits,
    Prompt,
)
from client.lookups.stored_prefix import StoredPrefix
from client.memory.buffers import Span
from client.memory.device_rows import DeviceRows
from client.stats import ClientStats
from kvstore.control.reports import ControlReport
from kvstore.index.records import ENTRY, LookupResult, NodeInfo, incarnation_tag
from kvstore.pages.hashing import block_hash_bytes, split_hashes
from kvstore.pages.heads import rank_units
from kvstore.pages.identity import BlockExtras, RequestIdentity, resolve
from kvstore.pages.keys import TOKEN_CHAIN, ChainPlace
from kvstore.pages.namespace import Namespace
from tests.support.memory_keyed import LEASE_MS, KeyedCalls, Stored

NODE = NodeInfo("memory", "memory:0", 0, "0" * 24 + "00c0ffee", number=0)
R = TypeVar("R")


@dataclass(frozen=True)
class Pinned:
    """One pin as the store saw it: the storage hashes it named, its TTL, and which of
    those pages the store held when it came (``MemoryClient.pin``)."""

    hashes: list[bytes]
    ttl_s: float | None
    held: list[bool]


class MemoryStore:
    """Pages by (storage namespace digest, chained block hash); ``opened``: every
    client made, in order (the connector's scheduler opens its engine's pages first).
    ``device``: gets land in "device" memory (the host: ``IntoDevice``, and layer by
    layer ``IntoLayers``), as a client with a device copier does."""

    def __init__(self, *, device: bool = False) -> None:
        self._pages: dict[tuple[bytes, bytes], bytes] = {}
        self._slots: dict[tuple[bytes, bytes], int] = {}
        self.opened: list[MemoryClient] = []
        self.pins: list[Pinned] = []  # every pin, in order (kept; nothing is evicted here)
        self.device = device
        self._evicting: set[bytes] = set()
        self.reads: list[str] = []  # each get's destination kind, in order (``read``)

    def client(self, namespace: Namespace) -> MemoryClient:
        made = MemoryClient(self, namespace)
        self.opened.append(made)
        return made

    def __len__(self) -> int:
        return len(self._pages)

    def _put(self, digest: bytes, page_hash: bytes, page: bytes) -> None:
        key = (digest, page_hash)
        self._slots.setdefault(key, len(self._slots))
        self._pages[key] = bytes(page)

    def _has(self, digest: bytes, page_hash: bytes) -> bool:
        return (digest, page_hash) in self._pages

    def evict_on_read(self, page_hashes: list[bytes]) -> None:
        """The pages of ``page_hashes`` (block hashes, any namespace) are evicted when
        the next get runs: after the lookup that found them, before the fetch."""
        self._evicting.update(page_hashes)

    def copy_from(self, other: MemoryStore) -> None:
        """Every page ``other`` holds, stored here too (a prefill's save arriving)."""
        for (digest, page_hash), page in other._pages.items():
            self._put(digest, page_hash, page)

    def _reading(self, into: object) -> None:
        self.reads.append(type(into).__name__)
        if self._evicting:
            for key in [k for k in self._pages if k[1] in self._evicting]:
                del self._pages[key]
            self._evicting.clear()


Identity = RequestIdentity | BlockExtras | None


class MemoryClient(KeyedCalls):
    """One namespace's lookups and pages in a ``MemoryStore`` (a ``PrefixStore`` and
    ``PageStore``; with ``KeyedCalls``, a keyed layout's ``KeyedStore``). ``down``:
    every lookup is a fault (None); ``latency``: seconds each lookup would take, a None
    when over its timeout. ``finds``: each lookup's blocks and ``last``;
    ``keyed_finds``: each keyed lookup's keys and whether it took a read lease."""

    def __init__(self, store: MemoryStore, namespace: Namespace) -> None:
        self._store = store
        self._namespace = namespace
        self._storage = namespace.storage
        self._digest = self._storage.digest
        units = rank_units(namespace)
        self._units = (units.first, units.count)
        self.down = False
        self.latency = 0.0
        self.closed = False
        self.finds: list[tuple[int, bool]] = []
        self.keyed_finds: list[tuple[int, bool]] = []
        self._heads = units
        self._stats = ClientStats()

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def heads(self) -> Any:
        return self._heads

    @property
    def stats(self) -> ClientStats:
        return self._stats

    @property
    def call_limit(self) -> float:
        return 5.0

    def units_nbytes(self, blocks: int) -> int:
        raise NotImplementedError("the memory store serves whole pages, not head-group units")

    def lands_on_device(self, memory: torch.device) -> bool:
        return self._store.device and memory.type == "cpu"

    def lands_layers(self, memory: torch.device) -> bool:
        return self.lands_on_device(memory)

    def chain(self, token_ids: Any, identity: Identity = None) -> list[bytes]:
        """The storage hashes of ``token_ids``' full blocks under ``identity``, as the
        real client's lookups and saves key them."""
        bs = self._storage.block_size
        return split_hashes(
            block_hash_bytes(self._storage, token_ids, resolve(identity, bs, len(token_ids)))
        )

    def put(
        self,
        token_ids: Any,
        pages: list[bytes],
        *,
        identity: Identity = None,
        start_block: int = 0,
    ) -> None:
        """Store ``pages`` as the full blocks ``start_block`` on of ``token_ids`` (as
        ``KVCacheClient.put_pages``; a state is one page at its boundary's block)."""
        chain = self.chain(token_ids, identity)
        if start_block + len(pages) > len(chain):
            raise ValueError(
                f"{len(pages)} pages from block {start_block}: {len(chain)} full blocks"
            )
        for i, page in enumerate(pages):
            self._store._put(self._digest, chain[start_block + i], page)

    def put_pages(
        self,
        token_ids: Any,
        pages: torch.Tensor,
        *,
        identity: Identity = None,
        start_block: int = 0,
    ) -> Stored:
        """``put`` of a worker's pages (``[n, *page_shape]``), as ``KVCacheClient.put_pages``."""
        held = [_page_bytes(page) for page in pages]
        self.put(token_ids, held, identity=identity, start_block=start_block)
        return Stored(len(held), 0, sum(len(p) for p in held))

    def pin(
        self, token_ids: Any, *, identity: Identity = None, ttl_s: float | None = None
    ) -> ControlReport:
        """Record a pin of ``token_ids``' full blocks under ``identity`` (as
        ``KVCacheClient.pin`` names them: by their storage hashes) in ``store.pins``;
        ``pages``: the pages it held of them."""
        chain = self.chain(token_ids, identity)
        held = [self._store._has(self._digest, h) for h in chain]
        self._store.pins.append(Pinned(chain, ttl_s, held))
        return ControlReport("pin", pages=sum(held))

    def find(
        self,
        token_ids: Any,
        timeout: float | None = None,
        *,
        identity: Identity = None,
        last: bool = False,
    ) -> StoredPrefix | None:
        chain = self.chain(token_ids, identity)
        self.finds.append((len(chain), last))
        if self._unanswered(timeout):
            return None
        return self._found(chain, last)

    def _unanswered(self, timeout: float | None) -> bool:
        """Whether a lookup asked within ``timeout`` seconds gets no answer (the index
        ``down``, or slower than ``timeout``: ``latency``)."""
        return self.down or (timeout is not None and self.latency > timeout)

    def _found(
        self,
        chain: list[bytes],
        last: bool,
        lease_ms: int = LEASE_MS,
        place: ChainPlace = TOKEN_CHAIN,
    ) -> StoredPrefix:
        """The answer to a lookup of the storage hashes ``chain``: the longest stored
        prefix (``last``: up to the last page stored), as ``PrefixLookup.stored_prefix``
        builds it, holding a read lease of ``lease_ms`` (0: none was taken)."""
        held = [self._store._has(self._digest, h) for h in chain]
        if last:
            matched = max((i + 1 for i, has in enumerate(held) if has), default=0)
            positions = [matched - 1] if matched else []
        else:
            matched = held.index(False) if False in held else len(held)
            positions = list(range(matched))
        records = np.zeros(len(positions), dtype=ENTRY)
        for r, pos in enumerate(positions):
            key = (self._digest, chain[pos])
            records["h0"][r], records["h1"][r] = np.frombuffer(chain[pos], dtype="<u8")
            records["slot"][r] = self._store._slots[key]
            records["size"][r] = len(self._store._pages[key])
            records["tag"][r] = incarnation_tag(NODE.incarnation)
        result = LookupResult(
            matched,
            records,
            np.array(positions, dtype=np.int64),
            np.zeros(len(positions), dtype=np.int64),
            {NODE.number: NODE},
        )
        joined = b"".join(chain[:matched])
        return StoredPrefix(
            self._storage.digest_hex,
            self._storage.block_size,
            joined,
            self._units,
            result,
            time.time(),
            lease_ms,
            last,
            place,
        )

    def pages(self, found: StoredPrefix) -> list[bytes | None]:
        """The pages ``found`` names, by position (None where a ``last`` prefix holds
        none, or a page is gone since): what a worker's fetch would bring."""
        hashes = split_hashes(found.joined)
        if found.storage != self._storage.digest_hex:
            raise ValueError("found in another storage namespace")
        return [
            None
            if found.last and pos < len(hashes) - 1
            else self._store._pages.get((self._digest, h))
            for pos, h in enumerate(hashes)
        ]

    def read(self, plan: GetPlan[R]) -> R:
        """Land the pages ``plan`` names where its destination says, blocks
        ``plan.start_block`` on, up to the first page missing; the tokens of the prefix
        that arrived (0 when none did past the start), as ``KVCacheClient.read``."""
        into: Any = plan.into
        self._store._reading(into)
        pages = plan.pages
        found = (
            self.find(pages.token_ids, identity=pages.identity)
            if isinstance(pages, Prompt)
            else pages
        )
        if found is None:
            return into.miss
        start = plan.start_block
        held = self.pages(found)[start : found.blocks]
        arrived = held[: held.index(None)] if None in held else held
        if isinstance(into, IntoUnits):
            raise NotImplementedError("the memory store serves whole pages, not head-group units")
        if isinstance(into, IntoLayers):
            _land_layers(into.rows, into.feed, arrived)
        else:
            for i, page in enumerate(arrived):
                assert page is not None
                _land(_sink(into, start, i), page)
        got = start + len(arrived)
        return got * self._storage.block_size if arrived else 0  # type: ignore[return-value]

    def close(self) -> None:
        self.closed = True


def _page_bytes(page: torch.Tensor) -> bytes:
    return page.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sink(into: Any, start: int, i: int) -> torch.Tensor | np.ndarray | tuple[np.ndarray, ...]:
    """Where the ``i``-th page of a get from block ``start`` lands: bytes in place."""
    if isinstance(into, IntoPages):
        return into.out[start + i]
    if isinstance(into, IntoSpans):
        span: Span = into.sinks[i]
        return span.bytes()
    if isinstance(into, IntoDevice):
        if isinstance(into.rows, DeviceRows):
            offset, nbytes = int(into.rows.offsets[i]), into.rows.nbytes
            return into.rows.base[offset : offset + nbytes]
        return into.rows[i]
    raise TypeError(f"the memory store lands no {type(into).__name__}")


def _land(sink: torch.Tensor | np.ndarray | tuple[np.ndarray, ...], page: bytes) -> None:
    """Copy ``page`` into ``sink`` (a tensor's bytes, a span's view or its pieces)."""
    data = np.frombuffer(page, dtype=np.uint8)
    if isinstance(sink, torch.Tensor):
        flat = sink.reshape(-1).view(torch.uint8)
        if flat.numel() != len(page):
            raise ValueError(f"a page of {len(page)} bytes into {flat.numel()}")
        flat.copy_(torch.from_numpy(data.copy()))
        return
    pieces = sink if isinstance(sink, tuple) else (sink,)
    if sum(p.nbytes for p in pieces) != len(page):
        raise ValueError(f"a page of {len(page)} bytes into {sum(p.nbytes for p in pieces)}")
    at = 0
    for piece in pieces:
        piece.reshape(-1)[:] = data[at : at + piece.nbytes]
        at += piece.nbytes


def _land_layers(rows: Any, feed: Any, arrived: list[bytes | None]) -> None:
    """An ``IntoLayers`` get: layer 0 of every page, then layer 1, ..., each layer's rows
    queued on ``feed`` once copied (the host as the device: no event to wait for)."""
    if not isinstance(rows, torch.Tensor):
        raise TypeError("the memory store feeds layers into a tensor of rows only")
    for layer in range(feed.layers):
        for i, page in enumerate(arrived):
            assert page is not None
            part = len(page) // feed.layers
            _land(rows[i, layer], page[layer * part : (layer + 1) * part])
        feed.queued(layer, range(len(arrived)), None)
