"""Pages split by KV head, so engines of any tensor-parallel size share them
(docs/key-format.md "Head groups").

A namespace's ``total_heads`` KV heads are stored in ``groups`` groups of
``group_heads`` heads each: one *unit* per block and group, laid out as a page of the
namespace's layout holding only that group's heads. Unit ``s`` of a block is keyed by
the block's chain hash with bytes 8-9 XOR ``s`` (little-endian u16): unit 0 is the
chain hash itself, every unit of a block sits at the block's position in its index
segment (one lookup reads them all), and hashing costs what it always did.

Layers are grouped the same way for pipeline parallelism (``Namespace.layer_groups``):
unit ``s`` is head group ``s % groups`` of layer group ``s // groups``, so a pipeline
stage's units are consecutive (it holds whole layer groups; a rank holding part of the
heads holds one layer group) and engines of any PP split that agree on the layer
groups share pages.

A tensor-parallel rank holds a range of heads (``Namespace.head_range``) and needs the
units that cover it (``RankUnits``); a pipeline stage, the layer groups of its layers.
Client code calls ``rank_units``, ``unit_hashes``, ``split`` (a rank's pages into its
units, for a put) and ``merge`` (received units into the rank's pages, for a get) or
``rank_parts`` (the same as views, for a caller that places them itself); lookups
match an index entry to a unit by its hash (``kvstore/index/_match.c``, ``UNIT_MASK``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from kvstore.pages.namespace import Namespace

# unit s of a block: the chain hash with this u64 (bytes 8-15, little-endian) XOR s
UNIT_MASK = 0xFFFF


@dataclass(frozen=True, slots=True)
class RankUnits:
    """The units one rank reads or writes: ``count`` units from ``first``, each of
    ``group_heads`` heads; the rank's heads start ``offset`` heads into the first unit
    and number ``rank_heads``; they are ``layer_units`` layer groups of
    ``head_units`` head groups each (``count`` is their product). ``whole`` when the
    rank's heads are exactly those units (only then can the rank store them);
    ``identity`` when one unit is the rank's whole page (pages move as they are, no
    split or merge)."""

    first: int
    count: int
    group_heads: int
    offset: int
    rank_heads: int
    layer_units: int = 1

    @property
    def head_units(self) -> int:
        return self.count // self.layer_units

    @property
    def whole(self) -> bool:
        return self.offset == 0 and self.rank_heads == self.head_units * self.group_heads

    @property
    def identity(self) -> bool:
        return self.count == 1 and self.whole


def rank_units(ns: Namespace) -> RankUnits:
    """The units covering the heads and layers of ``ns``'s rank."""
    lo, hi = ns.head_range
    g = ns.group_heads
    first, last = lo // g, (hi - 1) // g
    layers = ns.num_layers // ns.group_layers
    first_unit = ns.first_layer // ns.group_layers * ns.groups + first
    return RankUnits(
        first_unit, (layers - 1) * ns.groups + last - first + 1, g, lo - first * g, hi - lo, layers
    )


def _unit_dims(ns: Namespace, t: torch.Tensor, p: RankUnits) -> torch.Tensor:
    """``t`` (``[n, *page_shape]``) with its layer and head dimensions cut into
    (layer units, group layers) and (head units, group heads), those unit counts moved
    to the front: ``[layer units, head units, n, *unit_shape]`` (a view)."""
    dl, dh = 1 + ns.layer_dim, 1 + ns.head_dim
    group_layers = ns.num_layers // p.layer_units
    for d, cut in sorted(
        [(dl, (p.layer_units, group_layers)), (dh, (p.head_units, p.group_heads))], reverse=True
    ):
        t = t.unflatten(d, cut)  # the later dimension first, so the earlier index still holds
    dl, dh = (dl, dh + 1) if dl < dh else (dl + 1, dh)
    return t.movedim((dl, dh), (0, 1))


def unit_hashes(chain: list[bytes], first: int, count: int) -> list[bytes]:
    """The keys of units ``first`` to ``first + count - 1`` of every block of ``chain``,
    unit by unit (every block's unit ``first``, then every block's next unit): the
    order in which units are stored and fetched (``split``). Measured for 8,192 blocks:
    2.6 ms for one unit each (a TP=2 rank's), 4.5 ms for two, 16 ms for eight; cutting
    the result into 16-byte objects is most of it (the XOR is vectorised). Unit 0 alone
    is the chain itself, free. Lookups never call it (they match an entry's hash to the
    chain's, ``kvstore/index/_match.c``); only transfers name units."""
    if first == 0 and count == 1:
        return chain
    pairs = np.frombuffer(b"".join(chain), dtype="<u8").reshape(-1, 2)
    out = np.repeat(pairs[None, :, :], count, axis=0)
    out[:, :, 1] ^= np.arange(first, first + count, dtype="<u8")[:, None]
    raw = out.tobytes()
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def split(ns: Namespace, pages: torch.Tensor, p: RankUnits) -> torch.Tensor:
    """The rank's ``pages`` ``[n, *page_shape]`` as ``[count, n, *unit_shape]``,
    contiguous (one copy): the units to store, unit by unit. Unit-major order keeps
    each unit of consecutive blocks side by side, in the writer's memory and (as a put
    asks for slots in that order) in the node's pool, so a rank of any TP size reads
    a run of blocks of one unit as one message (block-major order made it one message
    per unit over UCX: 0.39x of whole pages, bench/transfer.py)."""
    return _unit_dims(ns, pages, p).flatten(0, 1).contiguous()


def rank_parts(
    ns: Namespace, units: torch.Tensor, p: RankUnits
) -> list[tuple[torch.Tensor, int, int]]:
    """The rank's pages as pieces of the received ``units`` ``[count, n, *unit_shape]``,
    without a copy: per unit, ``[n, *unit_shape]`` narrowed to the heads the rank needs
    of it, where those heads start among the rank's, and where its layers start among
    the rank's. Writing each piece at its place gives what ``merge`` copies into rank
    pages (the vLLM connector writes them straight into its paged cache)."""
    d = 1 + ns.head_dim
    group_layers = ns.num_layers // p.layer_units
    parts = []
    for i in range(p.layer_units):
        for j in range(p.head_units):
            lo = max(0, p.offset - j * p.group_heads)
            hi = min(p.group_heads, p.offset + p.rank_heads - j * p.group_heads)
            if hi > lo:
                parts.append(
                    (
                        units[i * p.head_units + j].narrow(d, lo, hi - lo),
                        j * p.group_heads + lo - p.offset,
                        i * group_layers,
                    )
                )
    return parts


def merge(ns: Namespace, units: torch.Tensor, out: torch.Tensor, p: RankUnits) -> None:
    """Copy received ``units`` ``[count, n, *unit_shape]`` into the rank's pages ``out``
    ``[n, *page_shape]``, taking only the rank's heads of partly needed units."""
    d = 1 + ns.head_dim
    if p.whole:  # one strided copy straight into the rank's pages
        _unit_dims(ns, out, p).copy_(units.unflatten(0, (p.layer_units, p.head_units)))
        return
    heads = units.movedim(0, d).flatten(d, d + 1)  # [n, ..., count * group_heads, ...]
    out.copy_(heads.narrow(d, p.offset, p.rank_heads))
