"""A store in this process's memory that keeps real page bytes and answers lookups by
the same rules as the index and nodes: ``MemoryStore`` (the pages) and
``MemoryStore.client(namespace)`` (a ``client.vllm.store.PrefixStore`` of one
namespace, as ``KVCacheClient`` is one).

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

For tests only (tests/vllm/test_scheduler_decisions.py through
tests/support/connector_harness.py): no worker can fetch from it through a
``KVCacheClient``; the harness's stand-in worker reads it with ``pages``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.lookups.stored_prefix import StoredPrefix
from kvstore.index.records import ENTRY, LookupResult, NodeInfo, incarnation_tag
from kvstore.pages.hashing import HASH_BYTES, block_hash_bytes
from kvstore.pages.heads import rank_units
from kvstore.pages.identity import BlockExtras, RequestIdentity, resolve
from kvstore.pages.namespace import Namespace

NODE = NodeInfo("memory", "memory:0", 0, "0" * 24 + "00c0ffee", number=0)
LEASE_MS = 60_000


@dataclass(frozen=True)
class Pinned:
    """One pin as the store saw it: the storage hashes it named, its TTL, and which of
    those pages the store held when it came (``MemoryClient.pin``)."""

    hashes: list[bytes]
    ttl_s: float | None
    held: list[bool]


class MemoryStore:
    """Pages by (storage namespace digest, chained block hash); ``opened``: every
    client made, in order (the connector's scheduler opens its engine's pages first)."""

    def __init__(self) -> None:
        self._pages: dict[tuple[bytes, bytes], bytes] = {}
        self._slots: dict[tuple[bytes, bytes], int] = {}
        self.opened: list[MemoryClient] = []
        self.pins: list[Pinned] = []  # every pin, in order (kept; nothing is evicted here)

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


Identity = RequestIdentity | BlockExtras | None


class MemoryClient:
    """One namespace's lookups and pages in a ``MemoryStore`` (a ``PrefixStore``).
    ``down``: every lookup is a fault (None); ``latency``: seconds each lookup would
    take, a None when over its timeout. ``finds``: each lookup's blocks and ``last``."""

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

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    def chain(self, token_ids: Any, identity: Identity = None) -> list[bytes]:
        """The storage hashes of ``token_ids``' full blocks under ``identity``, as the
        real client's lookups and saves key them."""
        bs = self._storage.block_size
        joined = block_hash_bytes(self._storage, token_ids, resolve(identity, bs, len(token_ids)))
        return [joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]

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

    def pin(self, token_ids: Any, *, identity: Identity = None, ttl_s: float | None = None) -> int:
        """Record a pin of ``token_ids``' full blocks under ``identity`` (as
        ``KVCacheClient.pin`` names them: by their storage hashes) in ``store.pins``;
        the pages it held of them."""
        chain = self.chain(token_ids, identity)
        held = [self._store._has(self._digest, h) for h in chain]
        self._store.pins.append(Pinned(chain, ttl_s, held))
        return sum(held)

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
        if self.down or (timeout is not None and self.latency > timeout):
            return None
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
            LEASE_MS,
            last,
        )

    def pages(self, found: StoredPrefix) -> list[bytes | None]:
        """The pages ``found`` names, by position (None where a ``last`` prefix holds
        none, or a page is gone since): what a worker's fetch would bring."""
        hashes = [found.joined[i : i + HASH_BYTES] for i in range(0, len(found.joined), HASH_BYTES)]
        if found.storage != self._storage.digest_hex:
            raise ValueError("found in another storage namespace")
        return [
            None
            if found.last and pos < len(hashes) - 1
            else self._store._pages.get((self._digest, h))
            for pos, h in enumerate(hashes)
        ]

    def close(self) -> None:
        self.closed = True
