"""A store in this process's memory that keeps real page bytes and answers lookups by
the same rules as the index and nodes: ``MemoryStore`` (the pages) and
``MemoryStore.client(namespace)`` (a ``client.vllm.store.PrefixStore`` and
``PageStore`` of one namespace, as ``KVCacheClient`` is both).

Not a mock: a page is kept under its namespace's storage digest and its chained block
hash (``kvstore.pages.hashing.block_hash_bytes`` over ``namespace.storage``, the
request identity resolved to blocks as ``PrefixLookup.chain_hashes`` resolves it: LoRA,
salt, weights revision, multimodal items, embeddings), so a prompt finds what an engine
of the same namespace and identity stored, and nothing else. Head groups
(``kvstore.pages.heads``) as on a node: what is kept is a unit of a block (the heads of
one group; a whole page when the namespace has one group), keyed by
``heads.unit_hashes`` (unit 0: the chain hash itself); a rank reads and writes the
units of its heads (``rank_units``). A block counts as stored only when every unit the
client asks for is, as the index's ``_match`` counts it (a scheduler's storage view
asks for every unit, a worker for its own). ``find`` answers with the longest stored
prefix of full blocks (``last``: the prefix up to the last block stored, gaps
allowed, holding that block alone, as ``IndexLookup.resolve``), as a
``StoredPrefix`` built as ``PrefixLookup.stored_prefix`` builds it, its replicas on
one "node" (this store). An index that cannot answer is ``down``; one slower than the
caller's timeout (``latency``, compared, not slept) is a None too, as the real
client's lookup past its budget.

Gets run by plan (``read``, as ``KVCacheClient.read``): the pages a plan names land,
as real bytes, where its destination says (host pages, spans of the caller's memory,
"device" rows with the host as the device, layer by layer with a feed), and the
prefix ends at the first page missing (evicted since the lookup: ``evict_on_read``),
as a node's get ends at the first page that did not arrive whole. A rank of several
units reads them as the real client does (``tests/support/memory_landing.py``): into
an ``IntoUnits`` buffer (the units and the blocks whose every unit arrived), or merged
into rank pages for ``IntoPages``; only whole pages land in spans or device rows. Puts
store a worker's pages as its units (``heads.split``), under the same keys; a rank
holding part of a head group cannot put. A keyed layout's pages (SGLang's HiCache keys)
are found, fetched and stored by the keyed calls (``tests/support/memory_keyed.py``).

For tests only (tests/vllm/test_scheduler_decisions.py, test_worker_*.py, through
tests/support/connector_harness.py): the connector's scheduler and its real
worker, both opening their stores here (``KVStoreConnector``'s ``stores``); SGLang's
HiCache backend in tests/support/sglang_memory_checks.py (``KVStoreHiCache``'s
``stores``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from client.gets.plan import GetPlan, IntoLayers, IntoUnits, Prompt
from client.lookups.stored_prefix import StoredPrefix
from client.stats import ClientStats
from kvstore.control.reports import ControlReport
from kvstore.errors import InvalidInputError
from kvstore.index.records import ENTRY, LookupResult, NodeInfo, incarnation_tag
from kvstore.pages.hashing import block_hash_bytes, split_hashes
from kvstore.pages.heads import RankUnits, rank_units, unit_hashes
from kvstore.pages.identity import BlockExtras, RequestIdentity, resolve
from kvstore.pages.keys import TOKEN_CHAIN, ChainPlace
from kvstore.pages.namespace import Namespace
from tests.support.memory_keyed import LEASE_MS, KeyedCalls, Stored
from tests.support.memory_landing import (
    land,
    land_layers,
    rank_pages,
    read_units,
    sink,
    units_of,
)

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
    """Pages (units) by (storage namespace digest, unit hash); ``opened``: every
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
        """The pages kept under ``page_hashes`` (any namespace: a block's hash is its
        unit 0, ``heads.unit_hashes`` names the others) are evicted when the next get
        runs: after the lookup that found them, before the fetch."""
        self._evicting.update(page_hashes)

    def copy_from(self, other: MemoryStore) -> None:
        """Every page ``other`` holds, stored here too (a prefill's save arriving)."""
        for (digest, page_hash), page in other._pages.items():
            self._put(digest, page_hash, page)

    def evict(self, page_hashes: list[bytes]) -> None:
        """The pages kept under ``page_hashes`` are gone now (as ``evict_on_read``)."""
        gone = set(page_hashes)
        for key in [k for k in self._pages if k[1] in gone]:
            del self._pages[key]

    def _reading(self, into: object) -> None:
        self.reads.append(type(into).__name__)
        self.evict(list(self._evicting))
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
        self._units = (units.first, units.count)  # what its lookups ask for
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
    def heads(self) -> RankUnits:
        return self._heads

    @property
    def stats(self) -> ClientStats:
        return self._stats

    @property
    def call_limit(self) -> float:
        return 5.0

    def units_nbytes(self, blocks: int) -> int:
        """Bytes of this rank's units of ``blocks`` blocks, as ``PageReader.units_nbytes``."""
        return blocks * self._heads.count * self._namespace.unit_nbytes

    def lands_on_device(self, memory: torch.device) -> bool:
        # whole pages only, as the real reader: a rank of head groups merges on the host
        return self._store.device and self._heads.identity and memory.type == "cpu"

    def lands_layers(self, memory: torch.device) -> bool:
        return self.lands_on_device(memory)

    def chain(self, token_ids: Any, identity: Identity = None) -> list[bytes]:
        """The storage hashes of ``token_ids``' full blocks under ``identity``, as the
        real client's lookups and saves key them."""
        bs = self._storage.block_size
        return split_hashes(
            block_hash_bytes(self._storage, token_ids, resolve(identity, bs, len(token_ids)))
        )

    def _keys(self, chain: list[bytes]) -> list[bytes]:
        """The keys of this rank's units of the blocks ``chain``, unit by unit."""
        return unit_hashes(chain, self._heads.first, self._heads.count)

    def _held(self, chain: list[bytes]) -> list[bool]:
        """Per block of ``chain``, whether every unit this rank asks for is stored."""
        has = [self._store._has(self._digest, k) for k in self._keys(chain)]
        return [all(has[b :: len(chain)]) for b in range(len(chain))]  # unit by unit

    def put(
        self,
        token_ids: Any,
        pages: list[bytes],
        *,
        identity: Identity = None,
        start_block: int = 0,
    ) -> None:
        """Store this rank's ``pages`` as the full blocks ``start_block`` on of
        ``token_ids`` (as ``KVCacheClient.put_pages``; a state is one page at its
        boundary's block); a rank of several units stores each page's units."""
        if self._heads.identity:  # any bytes, as a page (a state's too)
            self._put_units(token_ids, pages, identity, start_block)
        else:
            self.put_pages(
                token_ids,
                rank_pages(self._namespace, pages),
                identity=identity,
                start_block=start_block,
            )

    def _put_units(
        self, token_ids: Any, units: list[bytes], identity: Identity, start_block: int
    ) -> None:
        """``units`` (unit by unit) stored as this rank's units of blocks ``start_block`` on."""
        chain = self.chain(token_ids, identity)
        blocks = len(units) // self._heads.count
        if start_block + blocks > len(chain):
            raise ValueError(f"{blocks} pages from block {start_block}: {len(chain)} full blocks")
        keys = self._keys(chain[start_block : start_block + blocks])
        for key, unit in zip(keys, units, strict=True):
            self._store._put(self._digest, key, unit)

    def put_pages(
        self,
        token_ids: Any,
        pages: torch.Tensor,
        *,
        identity: Identity = None,
        start_block: int = 0,
    ) -> Stored:
        """``put`` of a worker's pages (``[n, *page_shape]``), as ``KVCacheClient.put_pages``:
        its units stored (and counted, as a ``PublishReport`` counts them)."""
        units = units_of(self._namespace, self._heads, pages)
        self._put_units(token_ids, units, identity, start_block)
        return Stored(len(units), 0, sum(len(u) for u in units))

    def pin(
        self, token_ids: Any, *, identity: Identity = None, ttl_s: float | None = None
    ) -> ControlReport:
        """Record a pin of ``token_ids``' full blocks under ``identity`` (as
        ``KVCacheClient.pin`` names them: by their storage hashes) in ``store.pins``;
        ``pages``: the pages it held of them."""
        chain = self.chain(token_ids, identity)
        held = self._held(chain)
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
        builds it, holding a read lease of ``lease_ms`` (0: none was taken): a record per
        unit of each block, numbered from the rank's first, as the index's ``_match``."""
        held = self._held(chain)
        if last:
            matched = max((i + 1 for i, has in enumerate(held) if has), default=0)
            positions = [matched - 1] if matched else []
        else:
            matched = held.index(False) if False in held else len(held)
            positions = list(range(matched))
        count, keys = self._heads.count, self._keys(chain)
        places = [(pos, j) for pos in positions for j in range(count)]
        records = np.zeros(len(places), dtype=ENTRY)
        for r, (pos, j) in enumerate(places):
            unit = keys[j * len(chain) + pos]
            key = (self._digest, unit)
            records["h0"][r], records["h1"][r] = np.frombuffer(unit, dtype="<u8")
            records["slot"][r] = self._store._slots[key]
            records["size"][r] = len(self._store._pages[key])
            records["tag"][r] = incarnation_tag(NODE.incarnation)
        result = LookupResult(
            matched,
            records,
            np.array([pos for pos, _ in places], dtype=np.int64),
            np.array([j for _, j in places], dtype=np.int64),
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

    def _stored(self, found: StoredPrefix) -> list[bytes | None]:
        """This rank's units of the blocks ``found`` names, unit by unit (None where a
        ``last`` prefix holds none, or a unit is gone since): what a fetch would bring."""
        if found.storage != self._storage.digest_hex:
            raise ValueError("found in another storage namespace")
        first, count = found.units
        mine = self._heads
        if not first <= mine.first <= mine.first + mine.count <= first + count:
            raise InvalidInputError(  # as PrefixLookup.check_found: not this rank's heads
                f"found for head groups {first}..{first + count - 1}, "
                f"this rank reads {mine.first}..{mine.first + mine.count - 1}"
            )
        blocks = found.blocks
        return [
            None
            if found.last and i % blocks < blocks - 1
            else self._store._pages.get((self._digest, key))
            for i, key in enumerate(self._keys(split_hashes(found.joined)))
        ]

    def pages(self, found: StoredPrefix) -> list[bytes | None]:
        """The pages ``found`` names, by position: this rank's units of each block,
        joined unit by unit (a whole page when the rank's page is one unit); None where
        one is missing (``_stored``)."""
        units, blocks = self._stored(found), found.blocks
        per_block = [[u for u in units[b::blocks] if u is not None] for b in range(blocks)]
        return [b"".join(got) if len(got) == len(units) // blocks else None for got in per_block]

    def read(self, plan: GetPlan[R]) -> R:
        """Land the pages ``plan`` names where its destination says, blocks
        ``plan.start_block`` on, up to the first block missing a unit; the tokens of the
        prefix that arrived (0 when none did past the start), as ``KVCacheClient.read``;
        for ``IntoUnits``, the units and the blocks that arrived whole."""
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
        start, rank, ns = plan.start_block, self._heads, self._namespace
        if isinstance(into, IntoUnits) or not rank.identity:
            return self._read_units(found, start, into)
        held = self.pages(found)[start : found.blocks]
        arrived = held[: held.index(None)] if None in held else held
        if isinstance(into, IntoLayers):
            land_layers(into.rows, into.feed, arrived)
        else:
            for i, page in enumerate(arrived):
                assert page is not None
                land(sink(into, start, i), page)
        got = start + len(arrived)
        return got * ns.block_size if arrived else 0  # type: ignore[return-value]

    def _read_units(self, found: StoredPrefix, start: int, into: Any) -> Any:
        """``read`` of this rank's units of ``found``'s blocks ``start`` on."""
        units, total, count = self._stored(found), found.blocks, self._heads.count
        # the blocks from ``start`` on of each unit, unit by unit
        stored = [u for j in range(count) for u in units[j * total + start : (j + 1) * total]]
        return read_units(self._namespace, self._heads, stored, into, start)

    def close(self) -> None:
        self.closed = True
