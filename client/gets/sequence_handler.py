"""A get of a whole sequence (``IntoSequence``): ``select``'s (``client.sequences``), a
medium added as one module, the way any other is (``client.gets.handlers``). Importing
it registers its handler for (the nodes, ``IntoSequence``); ``client.sequences`` does,
and reads ``GetPlan(SequencePages(hashes, parts), IntoSequence(tokens))``.

The sequence's blocks land straight in a key/value buffer lent from the client's host
pool (``codec.kv_spans``: this rank's units of each block are spans of it), its tail
parts (``client.codec``'s partial block and hidden states) in a second lent buffer,
every page checked on the host as it lands. A rank that reads part of a head group
receives the units into a buffer and merges its heads into key/value. A missing head
group or page ends the prefix, and the tail counts only when every block arrived:
never wrong bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from client import codec
from client.gets.fetch import leading, whole_blocks
from client.gets.handlers import NODES, Reader, register_handler
from client.gets.plan import Destination, FoundPages
from client.memory.buffers import split_spans
from kvstore.errors import InvalidInputError
from kvstore.pages import heads


@dataclass(frozen=True, slots=True)
class LandedSequence:
    """What a sequence get landed: ``kv`` ``[2, layers, tokens, heads, head_size]`` (lent
    from the host pool, back to it once dropped) whose leading ``blocks`` blocks arrived
    whole, and the tail buffer with its parts' sizes, of which the leading ``parts``
    arrived (0 unless every block found did). ``kv`` holds the whole sequence's tokens
    when tail parts were found after every block, else the blocks found."""

    kv: torch.Tensor
    blocks: int
    tail: np.ndarray
    part_sizes: list[int]
    parts: int


@dataclass(frozen=True, eq=False)
class IntoSequence(Destination[LandedSequence | None]):
    """A sequence of ``tokens`` tokens (``SequencePages``' blocks and tail parts) into
    buffers the handler lends, sized for what the lookup found; None when nothing was
    found (a miss, a fault or the blocking client's deadline)."""

    miss: ClassVar[None] = None
    sequence: ClassVar[bool] = True
    tokens: int


class SequenceHandler:
    """Lands a sequence's blocks in a lent key/value buffer (straight there, or merged
    from head-group units for a rank that reads part of a group) and its tail parts in
    a lent tail buffer, each page checked on the host as it lands. Called by
    ``PageReader.read`` for ``select``'s plans."""

    checks = "host"

    def check(self, reader: Reader, into: IntoSequence, count: int) -> None:
        if into.tokens < count * reader.namespace.block_size:
            raise InvalidInputError(f"{into.tokens} tokens cannot hold {count} full blocks")

    def empty(self, reader: Reader, into: IntoSequence) -> LandedSequence | None:
        return None

    async def land(self, reader: Reader, pages: FoundPages, into: IntoSequence) -> LandedSequence:
        ns, buffers, nblocks = reader.namespace, reader.buffers, pages.blocks
        # key and value are received into, sized for what the index says is there: the
        # whole sequence when tail parts follow every block, else the blocks found
        shape = (
            2,
            ns.num_layers,
            into.tokens if pages.result.matched > len(pages.hashes) else nblocks * ns.block_size,
            ns.num_kv_heads,
            ns.head_size,
        )
        kv = buffers.lend(int(np.prod(shape)) * ns.element_size, ns.torch_dtype(), shape)
        part_sizes = [loc[0].size for loc in pages.found_parts[1]]
        # the tail (partial block, hidden states) lands in pool memory, not a fresh array: a
        # select into fresh memory paid ~4,000 page faults per call (35 MB at the demo's size)
        tail_bytes = sum(part_sizes)
        lent = buffers.lend(max(tail_bytes, 1), torch.uint8, (max(tail_bytes, 1),))
        tail = lent.numpy()[:tail_bytes]
        tail_spans = split_spans(tail, part_sizes)
        # units that hold heads this rank lacks are received into a buffer and merged
        if not reader.rank.whole:
            blocks = await _merged(reader, pages, kv)
            got_parts = 0
            if blocks == nblocks and part_sizes:
                got_parts = leading(await reader.fetch_sequence(pages, tail_spans, units=False))
            return LandedSequence(kv, blocks, tail, part_sizes, got_parts)
        count = reader.rank.count
        sinks = codec.kv_spans(ns, kv[0], kv[1], nblocks, count) + tail_spans
        ok = await reader.fetch_sequence(pages, sinks)
        blocks = whole_blocks(ok, count, nblocks)
        got_parts = leading(ok[nblocks * count :]) if blocks == nblocks else 0
        return LandedSequence(kv, blocks, tail, part_sizes, got_parts)


async def _merged(reader: Reader, pages: FoundPages, kv: torch.Tensor) -> int:
    """The blocks of ``pages`` for a rank that reads part of a head group: the units land
    in a buffer and the rank's heads are merged into its pages, then into ``kv``; how
    many leading blocks arrived whole."""
    ns, nblocks = reader.namespace, pages.blocks
    units, blocks = await reader.fetch_units(
        pages.hashes,
        pages.result,
        0,
        torch.empty(reader.units_nbytes(nblocks), dtype=torch.uint8),
        end=nblocks,
    )
    merged = torch.empty((blocks, *ns.page_shape), dtype=ns.torch_dtype())
    heads.merge(ns, units[:, :blocks], merged, reader.rank)
    codec.pages_into_kv(merged, kv)
    return blocks


register_handler(NODES, IntoSequence, SequenceHandler())
