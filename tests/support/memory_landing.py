"""Where the memory store's gets land their bytes (``tests.support.memory_store``):
whole pages into the sinks of a plan's destination (host pages, spans, "device" rows,
layer by layer with a feed), and a rank's head-group units, as the real client lands
them (``client.gets.reads.PageReader.fetch_units``: the units ``[count, m,
*unit_shape]`` in the caller's buffer, unit by unit, and the leading blocks of which
every unit arrived), merged into rank pages where a plan wants pages
(``heads.merge``). Puts cut a rank's pages into the units a node stores
(``heads.split``, as ``client.puts.host_sources.PagesSource`` sends them).

Called by ``MemoryClient.read`` and ``put_pages`` only; every layout decision is
``kvstore.pages.heads``'s, none is made here."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from client.gets.fetch import whole_blocks
from client.gets.plan import IntoDevice, IntoPages, IntoSpans, IntoUnits
from client.memory.buffers import Span, host_bytes
from client.memory.device_rows import DeviceRows
from kvstore.errors import InvalidInputError
from kvstore.pages import heads
from kvstore.pages.heads import RankUnits
from kvstore.pages.namespace import Namespace


def page_bytes(page: torch.Tensor) -> bytes:
    """One page's (or unit's) bytes, in its C order, from any memory."""
    return page.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def rank_pages(ns: Namespace, pages: list[bytes]) -> torch.Tensor:
    """Pages given as bytes, as the ``[n, *page_shape]`` tensor a worker would put."""
    flat = torch.frombuffer(bytearray(b"".join(pages)), dtype=torch.uint8)
    return flat.view(ns.torch_dtype()).view(len(pages), *ns.page_shape)


def units_of(ns: Namespace, rank: RankUnits, pages: torch.Tensor) -> list[bytes]:
    """The units a put of ``rank``'s ``pages`` (``[n, *page_shape]``) stores, unit by
    unit as ``heads.unit_hashes`` keys them: the pages themselves for a rank whose page
    is one unit. Raises ``InvalidInputError`` for a rank holding part of a head group,
    which the real client refuses too (``Publisher.unit_keys``): it can only read."""
    if not rank.whole:
        raise InvalidInputError(
            f"this rank holds part of a head group ({ns.groups} groups of {ns.group_heads} "
            f"heads for tp_size {ns.tp_size}): it can read pages but not store them"
        )
    if rank.identity:
        return [page_bytes(page) for page in pages]
    units = heads.split(ns, pages.to("cpu"), rank)  # [count, n, *unit_shape], contiguous
    return [page_bytes(unit) for unit in units.flatten(0, 1)]


def land_units(
    ns: Namespace, rank: RankUnits, stored: list[bytes | None], buf: torch.Tensor, blocks: int
) -> tuple[torch.Tensor, int]:
    """``stored`` (the rank's units of ``blocks`` blocks, unit by unit; None where a
    unit is not held) into ``buf`` (host memory of at least ``units_nbytes(blocks)``
    bytes), as ``PageReader.fetch_units`` lands them: the units ``[count, blocks,
    *unit_shape]`` (a view of ``buf``) and how many leading blocks arrived whole (every
    one of their units: a missing unit ends the prefix there)."""
    count = rank.count
    need = blocks * count * ns.unit_nbytes
    flat = torch.from_numpy(host_bytes(buf))
    if flat.numel() < need:
        raise InvalidInputError(f"buf holds {flat.numel()} bytes; {blocks} blocks need {need}")
    units = flat[:need].view(ns.torch_dtype()).view(count, blocks, *ns.unit_shape)
    for i, unit in enumerate(stored):
        if unit is not None:  # a node sends each unit it holds, those past a gap too
            land(units[i // blocks, i % blocks], unit)
    return units, whole_blocks([u is not None for u in stored], count, blocks)


def merge_units(
    ns: Namespace, rank: RankUnits, stored: list[bytes | None], out: torch.Tensor, blocks: int
) -> int:
    """Rank pages ``out`` (``[blocks, *page_shape]``) from the rank's ``stored`` units,
    as ``PagesHandler`` lands a get of a rank of head groups (``Landing.UNITS``):
    through a buffer, the whole leading blocks merged (``heads.merge``). Returns them."""
    staging = torch.empty(blocks * rank.count * ns.unit_nbytes, dtype=torch.uint8)
    units, whole = land_units(ns, rank, stored, staging, blocks)
    if whole:
        heads.merge(ns, units[:, :whole], out[:whole], rank)
    return whole


def read_units(
    ns: Namespace, rank: RankUnits, stored: list[bytes | None], into: Any, start: int
) -> Any:
    """A get of a rank's units from block ``start`` on (``stored``: unit by unit, None
    where missing) into an ``IntoUnits`` buffer (the units and the blocks that arrived
    whole), or merged into ``IntoPages``' rank pages (the real ``PagesHandler``'s
    ``Landing.UNITS``: the tokens of the prefix that arrived, 0 when none did); no other
    destination takes units."""
    if not isinstance(into, IntoUnits | IntoPages):
        raise InvalidInputError(  # the real handlers' check: whole pages only there
            f"{type(into).__name__} needs a rank whose pages are whole head-group units; "
            "use get_found_units"
        )
    blocks = len(stored) // rank.count
    if not blocks:  # nothing past the start: the handler's ``empty``
        none = torch.empty((rank.count, 0, *ns.unit_shape), dtype=ns.torch_dtype())
        return (none, 0) if isinstance(into, IntoUnits) else 0
    if isinstance(into, IntoUnits):
        return land_units(ns, rank, stored, into.buf, blocks)
    whole = merge_units(ns, rank, stored, into.out[start : start + blocks], blocks)
    return (start + whole) * ns.block_size if whole else 0


def sink(into: Any, start: int, i: int) -> torch.Tensor | np.ndarray | tuple[np.ndarray, ...]:
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


def land(sink: torch.Tensor | np.ndarray | tuple[np.ndarray, ...], page: bytes) -> None:
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


def land_layers(rows: Any, feed: Any, arrived: list[bytes | None]) -> None:
    """An ``IntoLayers`` get: layer 0 of every page, then layer 1, ..., each layer's rows
    queued on ``feed`` once copied (the host as the device: no event to wait for)."""
    if not isinstance(rows, torch.Tensor):
        raise TypeError("the memory store feeds layers into a tensor of rows only")
    for layer in range(feed.layers):
        for i, page in enumerate(arrived):
            assert page is not None
            part = len(page) // feed.layers
            land(rows[i, layer], page[layer * part : (layer + 1) * part])
        feed.queued(layer, range(len(arrived)), None)
