"""A get described once (``GetPlan``): which pages (a prefix ``find`` found, a prompt
to look up, or a whole sequence's blocks and the tail parts chained after them), from
which source, landing where (a destination: one of the ``Into*`` specs here, or one a
handler module adds: ``IntoFile`` in ``client.gets.file_handler``, ``IntoSequence``,
select's, in ``client.gets.sequence_handler``), from which block on. Every get runs
through ``PageReader.read`` (``client.gets.reads``), which hands the pages to the
handler registered for the plan's (source, destination) pair
(``client.gets.handlers``).

How pages are checked is no choice a plan makes: every page is verified against its
xxh3 checksum where it lands (host memory as it is copied or received, device memory
after its copy), and the prefix ends at the first block that did not arrive whole.
Where that check runs is the handler's (``GetHandler.checks``).

The plan builders below (``pages_plan``, ``found_plan``, ...) are the public get
methods' one signature and documentation: ``AsyncKVCacheClient`` and
``KVCacheClient`` make each method from its builder (``client.gets.views``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar

import torch

from client.lookups.prefix import Identity
from client.lookups.stored_prefix import StoredPrefix
from client.memory.buffers import Span
from client.memory.device_rows import DeviceRows
from client.memory.layer_feed import LayerFeed
from kvstore.index import LookupResult, PageLocation

R = TypeVar("R")
# Where pages come from: the nodes, each reached over shared memory on the same host or
# over UCX (the node's connection chooses, per node: one get's pages may lie on both).
Source = Literal["nodes"]
# The nodes: the one source of gets there is today, and the one destination of puts
# (``client.puts.plan``); a handler's pair names them so (``client.gets.handlers``).
NODES: Source = "nodes"


@dataclass(frozen=True, slots=True)
class Prompt:
    """Pages of a prompt's full blocks, found by a lookup when the plan is read."""

    token_ids: Any
    identity: Identity = None


@dataclass(frozen=True, slots=True)
class SequencePages:
    """A whole sequence's pages (``select``'s, ``client.sequences``): its full blocks,
    by their chain ``hashes``, then its tail's ``parts`` (the partial block and hidden
    states, a chain of their own that follows the blocks in the index). One lookup
    asks for both; the parts count only after every block."""

    hashes: list[bytes]
    parts: list[bytes]


class Destination(Generic[R]):
    """Where a get's pages land, and what a get into it returns (``R``). ``miss`` is
    what the blocking client returns when the call gives up (a fault or its deadline).
    ``sequence``: the destination takes ``SequencePages`` (and only those, from block
    0); no other does. A subclass is a destination kind: handlers are registered by it."""

    miss: ClassVar[Any] = 0
    sequence: ClassVar[bool] = False


@dataclass(frozen=True, eq=False)
class IntoPages(Destination[int]):
    """This rank's pages, ``out[i]`` the page of block i (``[blocks, *page_shape]``, host
    or device memory): how they land (in place, staged, on the device, merged from head
    groups) is ``client.gets.landing``'s choice."""

    out: torch.Tensor


@dataclass(frozen=True, eq=False)
class IntoSpans(Destination[int]):
    """Whole pages into spans of the caller's host memory, one per block from the
    plan's start block on."""

    sinks: list[Span]


@dataclass(frozen=True, eq=False)
class IntoUnits(Destination[tuple[torch.Tensor | None, int]]):
    """This rank's head-group units into ``buf``, a contiguous host tensor; returns the
    units ``[count, m, *unit_shape]`` (a view of ``buf``) and the blocks that arrived whole."""

    miss: ClassVar[Any] = (None, 0)
    buf: torch.Tensor


@dataclass(frozen=True, eq=False)
class IntoDevice(Destination[int]):
    """Whole pages into device memory: back to back in ``rows`` (a contiguous tensor), or
    each at its offset of a ``DeviceRows``; no copy starts before ``after`` (a CUDA
    event) has passed on the device."""

    rows: torch.Tensor | DeviceRows
    after: Any = None


@dataclass(frozen=True, eq=False)
class IntoLayers(Destination[int]):
    """``IntoDevice`` landing layer by layer, back to back in ``rows``, ``feed`` telling a
    reader when each layer is in place (``client.memory.layer_feed``)."""

    rows: torch.Tensor | DeviceRows
    feed: LayerFeed
    after: Any = None


@dataclass(frozen=True, eq=False)
class GetPlan(Generic[R]):
    """One get: ``pages`` (a stored prefix, a prompt to look up, or a sequence) from
    ``source``, blocks ``start_block`` on, into ``into``. Blocks before ``start_block``
    must be stored for the prefix to count, but are not transferred."""

    pages: StoredPrefix | Prompt | SequencePages
    into: Destination[R]
    start_block: int = 0
    source: Source = "nodes"


@dataclass(frozen=True, slots=True)
class FoundPages:
    """A plan's pages as a handler lands them: the blocks' chain hashes, what the lookup
    found (``result.matched`` pages stored, at least one past ``start_block``), the
    first block to fetch, and a sequence's tail ``parts`` (``SequencePages``: found only
    past every block; none for other pages)."""

    hashes: list[bytes]
    result: LookupResult
    start_block: int
    parts: list[bytes] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        """The stored prefix's blocks: ``result.matched`` less the tail parts found."""
        return min(self.result.matched, len(self.hashes))

    @property
    def wanted(self) -> slice:
        """The blocks to fetch."""
        return slice(self.start_block, self.blocks)

    @property
    def count(self) -> int:
        """Blocks to fetch: ``start_block`` up to the stored prefix's end."""
        return self.blocks - self.start_block

    @property
    def found_parts(self) -> tuple[list[bytes], list[list[PageLocation]]]:
        """The tail parts found after every block, in order: their hashes and replicas."""
        n = self.blocks
        return self.parts[: self.result.matched - n], self.result.locations[n:]


# ---- the public get methods' one signature each (client.gets.views) ------------------


def pages_plan(
    token_ids: Any, out: torch.Tensor, start_block: int = 0, *, identity: Identity = None
) -> GetPlan[int]:
    """Fill ``out[start_block:k]`` with the longest stored prefix of full blocks of
    ``token_ids`` and return k * block_size (0 when fewer than ``start_block + 1``
    blocks are stored). Blocks before ``start_block`` must be stored for the prefix to
    count but are not transferred (the caller has them). Rows past k are unspecified.
    ``identity``: as for ``lookup``."""
    return GetPlan(Prompt(token_ids, identity), IntoPages(out), start_block)


def found_plan(found: StoredPrefix, out: torch.Tensor, start_block: int = 0) -> GetPlan[int]:
    """``get_pages`` of the prefix ``found`` (by ``find``, here or in another process
    of the same storage namespace and head groups at least this rank's), without an
    index round trip while at most half its read lease has passed; past that, the
    index is asked again, as ``get_pages`` would (the lease is what keeps the pages
    from eviction). Locations that went stale in between cost a shorter prefix,
    never wrong bytes: nodes check each page's hash and checksum."""
    return GetPlan(found, IntoPages(out), start_block)


def device_plan(
    found: StoredPrefix,
    rows: torch.Tensor | DeviceRows,
    start_block: int = 0,
    feed: LayerFeed | None = None,
    after: Any = None,
) -> GetPlan[int]:
    """``get_found`` straight into device memory: the pages of blocks ``start_block``
    on land back to back in ``rows`` (a contiguous tensor on the device, of at least
    ``(found.blocks - start_block) * page_nbytes`` bytes), or each at its own offset
    of a ``DeviceRows`` (``PagedCache.device_rows``: a block-major cache's own
    blocks, so no copy follows), copied from the node's memory by DMA on the same
    host (from pinned host memory over UCX) and checked on the device against their
    checksums. Returns the tokens of the prefix that arrived, as ``get_found``; rows
    past it are unspecified. For a rank whose head groups are its whole pages;
    ``lands_on_device`` says whether it can run. With ``feed``
    (``client.memory.layer_feed``: one per call), the pages land layer by layer, back
    to back, and ``feed`` tells a reader when each layer is in place
    (``lands_layers``). With ``after`` (a CUDA event), no copy starts before it has
    passed on the device: memory that earlier device work may still read. A fault or
    the blocking client's deadline gives 0."""
    into: Destination[int] = (
        IntoDevice(rows, after) if feed is None else IntoLayers(rows, feed, after)
    )
    return GetPlan(found, into, start_block)


def units_plan(
    found: StoredPrefix, buf: torch.Tensor, start_block: int = 0
) -> GetPlan[tuple[torch.Tensor | None, int]]:
    """``get_found`` for a caller that places this rank's head-group units itself (the
    vLLM connector writes them straight into its paged cache: one host copy fewer
    than ``get_found``'s merge into rank pages, and no staging buffer of the
    client's). Fetches into ``buf`` (a contiguous host tensor of at least
    ``units_nbytes(found.blocks - start_block)`` bytes) and returns the units of
    blocks ``start_block`` on, ``[count, m, *unit_shape]`` (a view of ``buf``), and how
    many of those blocks arrived whole (``heads.rank_parts`` cuts them). A fault or the
    blocking client's deadline gives (None, 0)."""
    return GetPlan(found, IntoUnits(buf), start_block)


def spans_plan(found: StoredPrefix, sinks: list[Span], start_block: int = 0) -> GetPlan[int]:
    """``get_found`` into ``sinks``, one per block from ``start_block`` on (at least
    ``found.blocks - start_block`` of them): pages scattered over the caller's memory
    (the vLLM connector's ``PagedCache.block_spans``: the cache's own blocks), so
    the node's slot is copied straight there on the same host, and through one
    scratch copy over UCX. Every page is verified by checksum; a block that did not
    arrive intact ends the prefix, and the bytes of the blocks past it are
    unspecified. For a rank whose head groups are its whole pages
    (``heads.identity``). A fault or the blocking client's deadline gives 0."""
    return GetPlan(found, IntoSpans(sinks), start_block)
