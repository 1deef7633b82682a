"""Gets: the stored prefix a lookup found, fetched into the caller's memory in the
form the caller holds it (``PageReader``)."""

from __future__ import annotations

from typing import Any

import torch

from client.codec import check_pages
from client.gets.fetch import ReplicaFetcher, leading, unit_requests, whole_blocks
from client.gets.landing import Landing, TransferMode, choose_landing, lands_in_place
from client.lookups.prefix import Identity, PrefixLookup
from client.lookups.stored_prefix import StoredPrefix
from client.memory.buffers import Span, host_bytes, page_spans
from client.memory.device_pages import DeviceCopier
from client.memory.device_rows import DeviceRows, device_spans
from client.memory.layer_feed import LayerFeed
from client.memory.staging import HostBuffers
from client.stats import ClientStats
from kvstore.errors import InvalidInputError
from kvstore.index import LookupResult
from kvstore.pages import heads
from kvstore.pages.hashing import split_hashes
from kvstore.pages.heads import RankUnits
from kvstore.pages.namespace import Namespace


class PageReader:
    """One job: fill a caller's memory with a stored prefix of full blocks: as rank
    pages (``get_pages``, ``get_found``), as this rank's head-group units
    (``get_found_units``) or straight into spans over the caller's own memory
    (``get_found_into``). How pages land is ``client.gets.landing``'s choice. Every page is
    verified by checksum; a block that did not arrive whole ends the prefix, and rows
    past it are unspecified. Runs on the client's event loop."""

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
        self._ns = namespace
        self._rank = rank
        self._stats = stats
        self._buffers = buffers
        self.transfer_mode = transfer_mode
        self._device = device

    def lands_on_device(self, memory: torch.device) -> bool:
        """Whether whole pages of this rank can land straight in ``memory`` (device memory
        the client's copier reaches: ``client.memory.device_pages``), checked there; False for
        host memory unless the copier's "device" is the host, and with
        ``transfer_mode='staged'``."""
        device = self._device
        return (
            device is not None
            and self.transfer_mode != "staged"
            and self._rank.identity
            and memory.type == device.device.type
            and _index(memory) == _index(device.device)
            and device.supports(self._ns.page_nbytes)
        )

    def lands_layers(self, memory: torch.device) -> bool:
        """Whether whole pages land in ``memory`` layer by layer (``get_found_device`` with a
        ``client.memory.layer_feed.LayerFeed``)."""
        return (
            self._ns.layer_dim == 0  # a layer of a page is one slice of it
            and self.lands_on_device(memory)
            and self._device is not None
            and self._device.lands_layers()
        )

    def units_nbytes(self, blocks: int) -> int:
        """Bytes of this rank's head-group units of ``blocks`` blocks."""
        return blocks * self._rank.count * self._ns.unit_nbytes

    async def get_pages(
        self, token_ids: Any, out: torch.Tensor, start_block: int, identity: Identity
    ) -> int:
        """``AsyncKVCacheClient.get_pages``: a lookup, then its blocks into ``out``."""
        hashes = split_hashes(self._lookups.chain_hashes(token_ids, identity))
        if not self._fetchable(out, len(hashes), start_block):
            return 0
        lookups = self._lookups
        result = await lookups.on_loop(lookups.lookup_steps, hashes)
        return await self._get(hashes, result, out, start_block)

    async def get_found(self, found: StoredPrefix, out: torch.Tensor, start_block: int) -> int:
        """``AsyncKVCacheClient.get_found``: ``found``'s blocks into ``out``."""
        self._lookups.check_found(found)
        if not self._fetchable(out, found.blocks, start_block):
            return 0
        return await self._get(
            split_hashes(found.joined), await self._lookups.found_result(found), out, start_block
        )

    async def get_found_units(
        self, found: StoredPrefix, buf: torch.Tensor, start_block: int
    ) -> tuple[torch.Tensor, int]:
        """``AsyncKVCacheClient.get_found_units``: ``found``'s units into ``buf``."""
        self._lookups.check_found(found)
        ns, count = self._ns, self._rank.count
        _check_start(start_block)
        m = found.blocks - start_block
        flat = host_bytes(buf) if m > 0 else None
        if flat is not None and flat.size < self.units_nbytes(m):
            raise InvalidInputError(
                f"buf holds {flat.size} bytes; {m} blocks of {count} units need {self.units_nbytes(m)}"
            )
        result = await self._lookups.found_result(found) if flat is not None else None
        if flat is None or not result or result.matched <= start_block:
            return torch.empty((count, 0, *ns.unit_shape), dtype=ns.torch_dtype()), 0
        return await self.fetch_units(
            split_hashes(found.joined), result, start_block, torch.from_numpy(flat)
        )

    async def get_found_into(self, found: StoredPrefix, sinks: list[Span], start_block: int) -> int:
        """``AsyncKVCacheClient.get_found_into``: ``found``'s pages into ``sinks``."""
        self._lookups.check_found(found)
        if not self._rank.identity:
            raise InvalidInputError(
                "get_found_into needs a rank whose pages are whole head-group units; use get_found_units"
            )
        _check_start(start_block)
        if len(sinks) < found.blocks - start_block:
            raise InvalidInputError(f"{len(sinks)} sinks for {found.blocks - start_block} blocks")
        if any(s.nbytes != self._ns.page_nbytes for s in sinks):
            raise InvalidInputError(
                f"every sink must hold one page of {self._ns.page_nbytes} bytes"
            )
        result = await self._lookups.found_result(found) if found.blocks > start_block else None
        if not result or result.matched <= start_block:
            return 0
        return await self._fetch_into(
            split_hashes(found.joined), result, start_block, sinks[: result.matched - start_block]
        )

    async def get_found_device(
        self,
        found: StoredPrefix,
        rows: torch.Tensor | DeviceRows,
        start_block: int,
        feed: LayerFeed | None = None,
        after: Any = None,
    ) -> int:
        """``AsyncKVCacheClient.get_found_device``: ``found``'s pages from ``start_block``
        on into ``rows`` (back to back in a tensor, or at a ``DeviceRows``' offsets),
        straight from the nodes' memory, once ``after`` has passed on the device."""
        self._lookups.check_found(found)
        _check_start(start_block)
        memory = rows.base.device if isinstance(rows, DeviceRows) else rows.device
        if not self.lands_on_device(memory):
            raise InvalidInputError(
                f"pages cannot land in {memory} memory here (no device copier for it, a "
                "rank of head groups, or transfer_mode='staged'): use get_found"
            )
        m = found.blocks - start_block
        if isinstance(rows, DeviceRows):
            self._check_rows(rows, max(m, 0), feed)
        elif not rows.is_contiguous():
            raise InvalidInputError("rows must be contiguous: pages land back to back in it")
        elif m > 0 and rows.numel() * rows.element_size() < m * self._ns.page_nbytes:
            raise InvalidInputError(
                f"rows hold {rows.numel() * rows.element_size()} bytes; {m} pages need "
                f"{m * self._ns.page_nbytes}"
            )
        if m <= 0:
            return 0
        result = await self._lookups.found_result(found)
        if not result or result.matched <= start_block:
            return 0
        self._stats.device_transfers += 1
        if feed is not None and (self._ns.layer_dim or feed.layers != self._ns.page_shape[0]):
            raise InvalidInputError(
                f"a feed of {feed.layers} layers for pages of shape {self._ns.page_shape} "
                f"({self._ns.layout}: layers on axis {self._ns.layer_dim})"
            )
        count = result.matched - start_block
        spans = (
            rows[:count]
            if isinstance(rows, DeviceRows)
            else device_spans(rows, count, self._ns.page_nbytes, feed)
        )
        if after is not None and self._device is not None:
            self._device.wait_for(after)
        return await self._fetch_into(split_hashes(found.joined), result, start_block, spans)

    def _check_rows(self, rows: DeviceRows, count: int, feed: LayerFeed | None) -> None:
        """Rows a caller placed (``PagedCache.device_rows``: a block-major cache's own
        blocks) must each hold one page inside their tensor, checkable there."""
        page, base = self._ns.page_nbytes, rows.base
        if feed is not None or rows.feed is not None:
            raise InvalidInputError("pages land layer by layer only into rows back to back")
        if rows.nbytes != page:
            raise InvalidInputError(f"rows of {rows.nbytes} bytes; a page has {page}")
        if len(rows) < count:
            raise InvalidInputError(f"{len(rows)} rows for {count} pages")
        if base.dtype != torch.uint8 or base.dim() != 1 or not base.is_contiguous():
            raise InvalidInputError("rows must lie in a flat contiguous uint8 tensor")
        at = rows.offsets[:count]
        if count and (int(at.min()) < 0 or int(at.max()) + page > base.numel() or (at % 8).any()):
            raise InvalidInputError(
                f"row offsets must be 8-byte aligned and leave a page inside the "
                f"{base.numel()}-byte tensor"
            )

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
        ns, count, m = self._ns, self._rank.count, end - start_block
        units = buf[: self.units_nbytes(m)].view(ns.torch_dtype()).view(count, m, *ns.unit_shape)
        requests = unit_requests(self._rank, hashes, result, slice(start_block, end))
        ok = await self._fetcher.fetch(
            *requests, page_spans(host_bytes(units), m * count, ns.unit_nbytes)
        )
        return units, whole_blocks(ok, count, m)

    def in_place_spans(self, out: torch.Tensor, blocks: slice) -> list[Span] | None:
        """``out``'s own pages of ``blocks`` as spans, or None when pages may not land in
        it (``landing.lands_in_place``: device memory, or ``transfer_mode='staged'``)."""
        if not lands_in_place(out.device.type, self.transfer_mode):
            return None
        return page_spans(host_bytes(out), blocks.stop, self._ns.page_nbytes)[blocks]

    def _fetchable(self, out: torch.Tensor, blocks: int, start_block: int) -> bool:
        """Checks a get's arguments; False when there is nothing to fetch."""
        check_pages(self._ns, "out", out, blocks, at_least=True)
        _check_start(start_block)
        return start_block < blocks

    async def _get(
        self, hashes: list[bytes], result: LookupResult | None, out: torch.Tensor, start_block: int
    ) -> int:
        """Fetch blocks ``start_block`` to ``result.matched`` of ``hashes`` into ``out``;
        the tokens of the prefix that arrived (see ``get_pages``)."""
        if not result or result.matched <= start_block:
            return 0
        n, nbytes, block_size = result.matched, self._ns.page_nbytes, self._ns.block_size
        wanted = slice(start_block, n)
        landing, spans = choose_landing(
            self._rank, lambda: self.in_place_spans(out, wanted), self.lands_on_device(out.device)
        )
        if landing is Landing.DEVICE:
            # straight from the nodes' memory into out's rows, checked on the device
            self._stats.device_transfers += 1
            rows = device_spans(out[start_block:n], n - start_block, nbytes)
            return await self._fetch_into(hashes, result, start_block, rows)
        if landing is Landing.IN_PLACE:
            self._stats.direct_transfers += 1
            return await self._fetch_into(hashes, result, start_block, spans or [])
        self._stats.staged_transfers += 1
        if landing is Landing.UNITS:
            # head groups land in staging and are merged into the rank's pages
            staging = torch.from_numpy(
                self._buffers.take_buffer(self.units_nbytes(n - start_block))
            )
            units, blocks = await self.fetch_units(hashes, result, start_block, staging)
            if blocks:
                heads.merge(
                    self._ns, units[:, :blocks], out[start_block : start_block + blocks], self._rank
                )
            self._buffers.give_buffer(
                staging
            )  # not when cancelled: a transfer may still be landing in it
            return (start_block + blocks) * block_size
        staging = torch.from_numpy(self._buffers.take_buffer((n - start_block) * nbytes))
        ok = await self._fetcher.fetch(
            *unit_requests(self._rank, hashes, result, wanted),
            page_spans(staging.numpy(), n - start_block, nbytes),
        )
        got = leading(ok)
        if got:
            flat = out.reshape(-1).view(torch.uint8)
            flat[start_block * nbytes : (start_block + got) * nbytes].copy_(staging[: got * nbytes])
        self._buffers.give_buffer(
            staging
        )  # not when cancelled: a transfer may still be landing in it
        return (start_block + got) * block_size

    async def _fetch_into(
        self,
        hashes: list[bytes],
        result: LookupResult,
        start_block: int,
        spans: list[Span] | DeviceRows,
    ) -> int:
        """Fetch whole pages of blocks ``start_block`` to ``result.matched`` into ``spans``
        (one per block); the tokens of the prefix that arrived."""
        ok = await self._fetcher.fetch(
            *unit_requests(self._rank, hashes, result, slice(start_block, result.matched)), spans
        )
        return (start_block + leading(ok)) * self._ns.block_size


def _index(memory: torch.device) -> int:
    """The device's index, the current one for a CUDA device named without one."""
    if memory.index is not None:
        return memory.index
    return torch.cuda.current_device() if memory.type == "cuda" else 0


def _check_start(start_block: int) -> None:
    if start_block < 0:
        raise InvalidInputError(f"start_block must not be negative, got {start_block}")
