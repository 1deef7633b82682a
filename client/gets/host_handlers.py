"""The built-in handlers of destinations a caller holds as host memory or as a tensor of
rank pages, from the nodes (``client.gets.handlers``): ``IntoPages`` (``get_pages``,
``get_found``: where pages land is ``client.gets.landing``'s choice), ``IntoSpans``
(``get_found_into``) and ``IntoUnits`` (``get_found_units``). Registered when
``client.gets.reads`` imports this module. Each page is checked on the host as it
lands, or on the device where ``IntoPages``' tensor is device memory the copier reaches."""

from __future__ import annotations

import torch

from client.codec import check_pages
from client.gets.fetch import leading
from client.gets.handlers import NODES, Reader, register_handler
from client.gets.landing import Landing, choose_landing
from client.gets.plan import FoundPages, IntoPages, IntoSpans, IntoUnits
from client.memory.buffers import host_bytes, page_spans
from client.memory.device_rows import device_spans
from kvstore.errors import InvalidInputError
from kvstore.pages import heads


class PagesHandler:
    """Rank pages into ``out[start_block:]``: on the device, in place, staged, or
    merged from head-group units (``choose_landing``), each counted in the client's
    stats. Returns the tokens of the prefix that arrived."""

    checks = "host or device"

    def check(self, reader: Reader, into: IntoPages, count: int) -> None:
        check_pages(reader.namespace, "out", into.out, count, at_least=True)

    def empty(self, reader: Reader, into: IntoPages) -> int:
        return 0

    async def land(self, reader: Reader, pages: FoundPages, into: IntoPages) -> int:
        out, ns, stats = into.out, reader.namespace, reader.stats
        start, n, nbytes = pages.start_block, pages.result.matched, ns.page_nbytes
        landing, spans = choose_landing(
            reader.rank,
            lambda: reader.in_place_spans(out, pages.wanted),
            reader.lands_on_device(out.device),
        )
        if landing is Landing.DEVICE:
            # straight from the nodes' memory into out's rows, checked on the device
            stats.device_transfers += 1
            return await reader.fetch_into(pages, device_spans(out[start:n], n - start, nbytes))
        if landing is Landing.IN_PLACE:
            stats.direct_transfers += 1
            return await reader.fetch_into(pages, spans or [])
        stats.staged_transfers += 1
        buffers, block_size = reader.buffers, ns.block_size
        if landing is Landing.UNITS:
            # head groups land in staging and are merged into the rank's pages
            staging = torch.from_numpy(buffers.take_buffer(reader.units_nbytes(n - start)))
            units, blocks = await reader.fetch_units(pages.hashes, pages.result, start, staging)
            if blocks:
                heads.merge(ns, units[:, :blocks], out[start : start + blocks], reader.rank)
            buffers.give_buffer(staging)  # not when cancelled: a transfer may still land in it
            return (start + blocks) * block_size
        staging = torch.from_numpy(buffers.take_buffer((n - start) * nbytes))
        ok = await reader.fetch_pages(pages, page_spans(staging.numpy(), n - start, nbytes))
        got = leading(ok)
        if got:
            flat = out.reshape(-1).view(torch.uint8)
            flat[start * nbytes : (start + got) * nbytes].copy_(staging[: got * nbytes])
        buffers.give_buffer(staging)  # not when cancelled: a transfer may still land in it
        return (start + got) * block_size


class SpansHandler:
    """Whole pages into the caller's spans (one per block from the start block on),
    each checked on the host as it lands. Returns the tokens of the prefix that arrived."""

    checks = "host"

    def check(self, reader: Reader, into: IntoSpans, count: int) -> None:
        if not reader.rank.identity:
            raise InvalidInputError(
                "get_found_into needs a rank whose pages are whole head-group units; use get_found_units"
            )
        if len(into.sinks) < count:
            raise InvalidInputError(f"{len(into.sinks)} sinks for {count} blocks")
        page = reader.namespace.page_nbytes
        if any(s.nbytes != page for s in into.sinks):
            raise InvalidInputError(f"every sink must hold one page of {page} bytes")

    def empty(self, reader: Reader, into: IntoSpans) -> int:
        return 0

    async def land(self, reader: Reader, pages: FoundPages, into: IntoSpans) -> int:
        return await reader.fetch_into(pages, into.sinks[: pages.count])


class UnitsHandler:
    """This rank's head-group units into the caller's host buffer, each checked on the
    host as it lands: the units and how many leading blocks arrived whole."""

    checks = "host"

    def check(self, reader: Reader, into: IntoUnits, count: int) -> None:
        if count <= 0:
            return
        size, need = host_bytes(into.buf).size, reader.units_nbytes(count)
        if size < need:
            raise InvalidInputError(
                f"buf holds {size} bytes; {count} blocks of {reader.rank.count} units need {need}"
            )

    def empty(self, reader: Reader, into: IntoUnits) -> tuple[torch.Tensor | None, int]:
        ns = reader.namespace
        return torch.empty((reader.rank.count, 0, *ns.unit_shape), dtype=ns.torch_dtype()), 0

    async def land(
        self, reader: Reader, pages: FoundPages, into: IntoUnits
    ) -> tuple[torch.Tensor | None, int]:
        buf = torch.from_numpy(host_bytes(into.buf))
        return await reader.fetch_units(pages.hashes, pages.result, pages.start_block, buf)


register_handler(NODES, IntoPages, PagesHandler())
register_handler(NODES, IntoSpans, SpansHandler())
register_handler(NODES, IntoUnits, UnitsHandler())
