"""The seam between a storage node's memory and the tier below it: ``Tier``, and
``NoTier`` for a node without a disk.

Calls cross it in one direction, from memory down:

- the evictor (server/eviction.py), before it frees memory slots, lets the tier write
  the pages it is about to take (``before_evict``), skips dirty pages the tier would
  still write (``demotable``), and tells it of every page that left the node
  (``dropped``);
- the data plane tells it of pages a put made ready (``committed``) and, for a get,
  has it read pages that are only on the tier back into memory slots (``load``,
  server/dataplane/readthrough.py);
- the node (server/node.py) starts and stops it, and asks what /healthz and the
  registry say about it.

A tier reads and changes the page table only through ``PageStore``'s methods
(server/store.py); it never calls memory back. server/disk/tier.py is the one tier
below memory today (docs/storage-tiers.md)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from server.page import StoredPage


class Tier(Protocol):
    """What memory tells the tier below it, and what the node asks of it."""

    # ---- what memory tells the tier -------------------------------------------------

    async def before_evict(self, order: Iterator[StoredPage], nbytes: int) -> None:
        """Memory is about to evict ``nbytes`` of slots, taking pages in ``order`` (the
        evictor's, least recently used first; read it at once, before any await): write
        the dirty pages among them the tier takes and wait for them, so they leave
        memory clean (still ready, on the tier) instead of being dropped."""

    def demotable(self, page: StoredPage) -> bool:
        """Whether this dirty page is written to the tier before memory may let it go
        (the evictor skips it until then); False: an eviction drops it."""

    def dropped(self, page: StoredPage) -> None:
        """The page left the node (evicted, or found corrupt): free its copy here."""

    def committed(self, pages: list[StoredPage]) -> None:
        """A put made these pages ready."""

    async def load(self, pages: list[StoredPage]) -> None:
        """Read pinned pages that are only on the tier into the memory slots they were
        just given (``offset`` set, ``loading`` set by the caller). Afterwards a page
        with ``offset`` set is in memory and verified; one whose read or check failed
        lost its slot and left the node, and reads as missing. Never wrong bytes."""

    def keep(self, pages: list[StoredPage]) -> None:
        """These ready pages were pinned (server/control/): give them a copy on the tier
        soon, so that the pins outlive a restart."""

    # ---- what the node asks of it -----------------------------------------------------

    def start(self) -> None:
        """Start background work on the running loop (after the page table is filled)."""

    async def stop(self) -> None:
        """Let work in flight end, make what was written durable, release the tier."""

    def predecessor(self) -> str:
        """The incarnation this node's previous run registered ('' when unknown): the
        tier kept its pages, so the node takes that registry entry over at once."""

    async def record_incarnation(self, incarnation: str) -> None:
        """Remember the incarnation just registered, for the next run's ``predecessor``."""

    def usage(self) -> dict[str, str]:
        """Figures for the registry entry (``kvstore stats``); empty without a tier."""

    def status_lines(self) -> list[str]:
        """Lines /healthz adds to its body (a degraded tier: the node still serves)."""


class NoTier(Tier):
    """The tier of a node without a disk: nothing below memory, so an evicted page is
    dropped and no page is ever only on a tier."""

    async def before_evict(self, order: Iterator[StoredPage], nbytes: int) -> None:
        return None

    def demotable(self, page: StoredPage) -> bool:
        return False

    def dropped(self, page: StoredPage) -> None:
        return None

    def committed(self, pages: list[StoredPage]) -> None:
        return None

    async def load(self, pages: list[StoredPage]) -> None:
        return None

    def keep(self, pages: list[StoredPage]) -> None:
        return None

    def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def predecessor(self) -> str:
        return ""

    async def record_incarnation(self, incarnation: str) -> None:
        return None

    def usage(self) -> dict[str, str]:
        return {}

    def status_lines(self) -> list[str]:
        return []
