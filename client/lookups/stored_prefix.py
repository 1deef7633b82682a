"""``StoredPrefix``: what a prefix lookup found, kept so that a later get fetches it
without asking the index again.

Made by ``client.lookups.prefix.PrefixLookup`` (``find_steps``, ``stored_prefix``); read by
the clients' ``get_found*`` calls (``client.gets.reads``), and carried between
processes by the vLLM connector (its scheduler looks up, its workers fetch). A frozen,
picklable value: it holds the matched blocks' storage hashes, their live replicas and
when the lookup's read lease began; it asks nothing of the index or the nodes itself."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvstore.index import LookupResult
from kvstore.pages.hashing import HASH_BYTES
from kvstore.pages.keys import TOKEN_CHAIN, ChainPlace


@dataclass(frozen=True, slots=True)
class StoredPrefix:
    """What ``find`` learnt about a prompt's stored prefix, for ``get_found``: another
    client of the same storage namespace (a TP worker of the engine whose scheduler
    looked up, in another process) fetches from it without asking the index again.
    Picklable. ``joined``: the storage chain hashes of the matched blocks, joined (an
    object per block would cost the scheduler's lookup 0.35 ms at 8,192 blocks and its
    pickling more; only workers split them); ``result``: their live replicas, every head
    group in ``units`` (first, count); ``taken``: the wall-clock time of the lookup,
    whose read lease (``lease_ms``) runs from then. ``last``: only the last block's page
    is stored and fetched (a hybrid model's boundary state, ``PrefixLookup.find_steps`` with
    ``last``). ``place``: where the chain lies in the index's segments (keyed pages,
    ``PrefixLookup.keyed_place``)."""

    storage: str  # digest of the storage namespace
    block_size: int
    joined: bytes
    units: tuple[int, int]
    result: LookupResult
    taken: float
    lease_ms: int
    last: bool = False
    place: ChainPlace = TOKEN_CHAIN

    @property
    def blocks(self) -> int:
        """Blocks of the stored prefix."""
        return len(self.joined) // HASH_BYTES

    @property
    def tokens(self) -> int:
        """Tokens of the stored prefix (a multiple of block_size)."""
        return self.blocks * self.block_size

    def head(self, blocks: int) -> StoredPrefix:
        """The first ``blocks`` blocks of this prefix (all of it when it is shorter),
        under the same lease: the vLLM connector loads no further than every namespace
        it loads from holds."""
        if blocks >= self.blocks:
            return self
        return replace(
            self, joined=self.joined[: max(blocks, 0) * HASH_BYTES], result=self.result.head(blocks)
        )
