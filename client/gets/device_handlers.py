"""The built-in handlers of device destinations, from the nodes
(``client.gets.handlers``): ``IntoDevice`` (``get_found_device``: pages straight into
device rows, checked there) and ``IntoLayers`` (the same, layer by layer through a
``LayerFeed``). Registered when ``client.gets.reads`` imports this module. The bytes
move through the client's device copier (``client.memory.device_pages``), which the
nodes' connections land pages with; this module only checks the rows and hands them on."""

from __future__ import annotations

import torch

from client.gets.handlers import NODES, Reader, register_handler
from client.gets.plan import FoundPages, IntoDevice, IntoLayers
from client.memory.device_rows import DeviceRows, device_spans
from client.memory.layer_feed import LayerFeed
from kvstore.errors import InvalidInputError


class DeviceHandler:
    """Whole pages into device rows (back to back in a tensor, or at a ``DeviceRows``'
    offsets), copied by the device copier and checked on the device, once the plan's
    ``after`` event has passed; with ``IntoLayers`` layer by layer through its feed.
    Returns the tokens of the prefix that arrived."""

    checks = "device"

    def check(self, reader: Reader, into: IntoDevice | IntoLayers, count: int) -> None:
        rows, feed = into.rows, _feed(into)
        memory = rows.base.device if isinstance(rows, DeviceRows) else rows.device
        if not reader.lands_on_device(memory):
            raise InvalidInputError(
                f"pages cannot land in {memory} memory here (no device copier for it, a "
                "rank of head groups, or transfer_mode='staged'): use get_found"
            )
        page = reader.namespace.page_nbytes
        if isinstance(rows, DeviceRows):
            _check_rows(rows, page, max(count, 0), feed)
        elif not rows.is_contiguous():
            raise InvalidInputError("rows must be contiguous: pages land back to back in it")
        elif count > 0 and rows.numel() * rows.element_size() < count * page:
            raise InvalidInputError(
                f"rows hold {rows.numel() * rows.element_size()} bytes; {count} pages need "
                f"{count * page}"
            )

    def empty(self, reader: Reader, into: IntoDevice | IntoLayers) -> int:
        return 0

    async def land(self, reader: Reader, pages: FoundPages, into: IntoDevice | IntoLayers) -> int:
        ns, rows, feed = reader.namespace, into.rows, _feed(into)
        reader.stats.device_transfers += 1
        if feed is not None and (ns.layer_dim or feed.layers != ns.page_shape[0]):
            raise InvalidInputError(
                f"a feed of {feed.layers} layers for pages of shape {ns.page_shape} "
                f"({ns.layout}: layers on axis {ns.layer_dim})"
            )
        count = pages.count
        spans = (
            rows[:count]
            if isinstance(rows, DeviceRows)
            else device_spans(rows, count, ns.page_nbytes, feed)
        )
        if into.after is not None and reader.device is not None:
            reader.device.wait_for(into.after)
        return await reader.fetch_into(pages, spans)


def _feed(into: IntoDevice | IntoLayers) -> LayerFeed | None:
    return into.feed if isinstance(into, IntoLayers) else None


def _check_rows(rows: DeviceRows, page: int, count: int, feed: LayerFeed | None) -> None:
    """Rows a caller placed (``PagedCache.device_rows``: a block-major cache's own
    blocks) must each hold one page inside their tensor, checkable there."""
    base = rows.base
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


_HANDLER = DeviceHandler()
register_handler(NODES, IntoDevice, _HANDLER)
register_handler(NODES, IntoLayers, _HANDLER)
