"""Gets: every get runs here, as a plan (``client.gets.plan.GetPlan``) through the
handler of its (source, destination) pair (``client.gets.handlers``): ``PageReader``.
The public get methods of both clients are views that build a plan and read it
(``client.gets.views``)."""

from __future__ import annotations

from typing import TypeVar, cast

import torch

# the built-in handlers register themselves on import (client.gets.handlers)
from client.gets import device_handlers, host_handlers  # noqa: F401
from client.gets.fetch import (
    ReplicaFetcher,
    leading,
    unit_locations,
    unit_requests,
    whole_blocks,
)
from client.gets.handlers import handler_for
from client.gets.landing import TransferMode, lands_in_place
from client.gets.plan import FoundPages, GetPlan, Prompt, SequencePages
from client.lookups.prefix import PrefixLookup
from client.memory.buffers import Span, host_bytes, page_spans
from client.memory.device_pages import DeviceCopier
from client.memory.device_rows import DeviceRows
from client.memory.staging import HostBuffers
from client.stats import ClientStats
from kvstore.errors import InvalidInputError
from kvstore.index import LookupResult
from kvstore.pages.hashing import split_hashes
from kvstore.pages.heads import RankUnits
from kvstore.pages.namespace import Namespace

R = TypeVar("R")


class PageReader:
    """One job: fill a caller's memory with a stored prefix of full blocks, as a plan
    says (``read``), and the fetches its handlers land pages with (``fetch_pages``,
    ``fetch_into``, ``fetch_units``: the ``client.gets.handlers.Reader`` they see).
    Every page is verified by checksum where it lands; a block that did not arrive whole
    ends the prefix, and rows past it are unspecified. Runs on the client's event loop;
    ``lands_on_device``, ``lands_layers`` and ``units_nbytes`` on any thread."""

    def __init__(
        self,
        lookups: PrefixLookup,
        fetcher: ReplicaFetcher,
        namespace: Namespace,
        rank: RankUnits,
        stats: ClientStats,
        buffers: HostBuffers,
        transfer_mode: TransferMode,
        device: DeviceCopier | None = None,
    ) -> None:
        self._lookups = lookups
        self._fetcher = fetcher
        self.namespace = namespace
        self.rank = rank
        self.stats = stats
        self.buffers = buffers
        self.transfer_mode = transfer_mode
        self.device = device

    def lands_on_device(self, memory: torch.device) -> bool:
        """Whether whole pages of this rank can land straight in ``memory`` (device memory
        the client's copier reaches: ``client.memory.device_pages``), checked there; False for
        host memory unless the copier's "device" is the host, and with
        ``transfer_mode='staged'``."""
        device = self.device
        return (
            device is not None
            and self.transfer_mode != "staged"
            and self.rank.identity
            and memory.type == device.device.type
            and _index(memory) == _index(device.device)
            and device.supports(self.namespace.page_nbytes)
        )

    def lands_layers(self, memory: torch.device) -> bool:
        """Whether whole pages land in ``memory`` layer by layer (``get_found_device`` with a
        ``client.memory.layer_feed.LayerFeed``)."""
        return (
            self.namespace.layer_dim == 0  # a layer of a page is one slice of it
            and self.lands_on_device(memory)
            and self.device is not None
            and self.device.lands_layers()
        )

    def units_nbytes(self, blocks: int) -> int:
        """Bytes of this rank's head-group units of ``blocks`` blocks."""
        return blocks * self.rank.count * self.namespace.unit_nbytes

    async def read(self, plan: GetPlan[R]) -> R:
        """Run ``plan``: its pages found (a lookup for a ``Prompt``, one for a
        ``SequencePages``' blocks and tail parts together; a ``StoredPrefix`` without one
        while its lease is young), checked against its destination, and
        landed by the handler of its (source, destination) pair
        (``client.gets.handlers``). Misuse raises ``InvalidInputError`` before any lookup
        (``SequencePages`` into any but a sequence destination, or from a later block);
        a get with nothing to fetch returns the handler's ``empty``."""
        handler = handler_for(plan.source, type(plan.into))
        pages, start, lookups = plan.pages, plan.start_block, self._lookups
        parts: list[bytes] = []
        if isinstance(pages, SequencePages) != plan.into.sequence or (plan.into.sequence and start):
            raise InvalidInputError(
                "a sequence's pages land whole (from block 0) in a sequence destination, and "
                f"only there: {type(pages).__name__} into {type(plan.into).__name__}"
            )
        if isinstance(pages, SequencePages):
            hashes, parts = pages.hashes, pages.parts
        elif isinstance(pages, Prompt):
            hashes = split_hashes(lookups.chain_hashes(pages.token_ids, pages.identity))
        else:
            lookups.check_found(pages)
            hashes = split_hashes(pages.joined)
        if start < 0:
            raise InvalidInputError(f"start_block must not be negative, got {start}")
        handler.check(self, plan.into, len(hashes) - start)
        if start >= len(hashes) + len(parts):
            return cast(R, handler.empty(self, plan.into))
        if isinstance(pages, SequencePages):  # one round trip: the parts chain after the blocks
            result = await lookups.on_loop(lookups.lookup_steps, hashes + parts, [len(hashes)])
        elif isinstance(pages, Prompt):
            result = await lookups.on_loop(lookups.lookup_steps, hashes)
        else:
            result = await lookups.found_result(pages)
        if not result or result.matched <= start:
            return cast(R, handler.empty(self, plan.into))
        found = FoundPages(hashes, result, start, parts)
        return cast(R, await handler.land(self, found, plan.into))

    async def fetch_units(
        self,
        hashes: list[bytes],
        result: LookupResult,
        start_block: int,
        buf: torch.Tensor,
        end: int | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Fetch this rank's units of blocks ``start_block`` to ``end`` (``result.matched``
        when None) into the uint8 host tensor ``buf``: the units ``[count, m, *unit_shape]``
        and how many leading blocks arrived whole."""
        end = result.matched if end is None else end
        ns, count, m = self.namespace, self.rank.count, end - start_block
        units = buf[: self.units_nbytes(m)].view(ns.torch_dtype()).view(count, m, *ns.unit_shape)
        requests = unit_requests(self.rank, hashes, result, slice(start_block, end))
        ok = await self._fetcher.fetch(
            *requests, page_spans(host_bytes(units), m * count, ns.unit_nbytes)
        )
        return units, whole_blocks(ok, count, m)

    def in_place_spans(self, out: torch.Tensor, blocks: slice) -> list[Span] | None:
        """``out``'s own pages of ``blocks`` as spans, or None when pages may not land in
        it (``landing.lands_in_place``: device memory, or ``transfer_mode='staged'``)."""
        if not lands_in_place(out.device.type, self.transfer_mode):
            return None
        return page_spans(host_bytes(out), blocks.stop, self.namespace.page_nbytes)[blocks]

    async def fetch_pages(self, pages: FoundPages, spans: list[Span] | DeviceRows) -> list[bool]:
        """Whole pages of ``pages`` (blocks ``start_block`` on) into ``spans``, one per
        block: per page, whether it arrived intact (checked where it landed)."""
        return await self._fetcher.fetch(
            *unit_requests(self.rank, pages.hashes, pages.result, pages.wanted), spans
        )

    async def fetch_into(self, pages: FoundPages, spans: list[Span] | DeviceRows) -> int:
        """``fetch_pages``: the tokens of the prefix that arrived."""
        ok = await self.fetch_pages(pages, spans)
        return (pages.start_block + leading(ok)) * self.namespace.block_size

    async def fetch_sequence(
        self, pages: FoundPages, spans: list[Span], *, units: bool = True
    ) -> list[bool]:
        """This rank's units of ``pages``' blocks (none unless ``units``; unit by unit,
        ``heads.unit_hashes``' order), then the tail parts found after them
        (``FoundPages.found_parts``), into ``spans`` in that order, in one fetch: per
        request, whether it arrived intact."""
        tail, tail_locations = pages.found_parts
        if not units:
            return await self._fetcher.fetch(tail, tail_locations, spans)
        keys, locations = unit_locations(self.rank, pages.hashes, pages.result, pages.wanted)
        return await self._fetcher.fetch(keys + tail, locations + tail_locations, spans)


def _index(memory: torch.device) -> int:
    """The device's index, the current one for a CUDA device named without one."""
    if memory.index is not None:
        return memory.index
    return torch.cuda.current_device() if memory.type == "cuda" else 0
