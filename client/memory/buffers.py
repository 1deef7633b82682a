"""Byte spans over host memory that pages are sent from and received into.

A span is a slice of a flat uint8 array, or a page scattered over the caller's
tensors (``pieces``: insert and select move pages straight between the nodes and the
caller's ``[layers, tokens, heads, head_size]`` key and value, with no page buffer
between them). Spans that sit back to back in one array travel as a single UCX
message without a copy; others are packed (send) or landed in a scratch buffer and
scattered (receive). The same-host path copies between a node's slots and either
kind (kvstore.pages.checksum.copy_checksummed)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.wire import protocol as P


@dataclass(frozen=True, slots=True)
class Span:
    base: np.ndarray
    offset: int
    nbytes: int
    # Set for a scattered page: uint8 views whose C orders, one after another, are its bytes.
    pieces: tuple[np.ndarray, ...] = ()

    def view(self) -> np.ndarray:
        """The page's bytes in place (a contiguous span only)."""
        if self.pieces:
            raise ValueError("a scattered span has no single view")
        return self.base[self.offset : self.offset + self.nbytes]

    def bytes(self) -> np.ndarray | tuple[np.ndarray, ...]:
        """What ``copy_checksummed`` copies to or from: the view, or the pieces."""
        return self.pieces or self.view()


def scattered_span(pieces: tuple[np.ndarray, ...]) -> Span:
    """A page held by ``pieces`` (uint8 views of the caller's tensors, in page order)."""
    return Span(pieces[0], 0, sum(p.nbytes for p in pieces), tuple(pieces))


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view sharing memory with a contiguous CPU tensor."""
    if t.device.type != "cpu":
        raise ValueError("host_bytes needs a CPU tensor")
    return t.reshape(-1).view(torch.uint8).numpy()


def page_spans(flat: np.ndarray, count: int, page_nbytes: int) -> list[Span]:
    return [Span(flat, i * page_nbytes, page_nbytes) for i in range(count)]


def split_spans(flat: np.ndarray, sizes: list[int]) -> list[Span]:
    spans, pos = [], 0
    for size in sizes:
        spans.append(Span(flat, pos, size))
        pos += size
    return spans


def adjacent(spans: list[Span]) -> bool:
    """True when the spans lie back to back in one array."""
    first = spans[0]
    pos = first.offset
    for s in spans:
        if s.pieces or s.base is not first.base or s.offset != pos:
            return False
        pos += s.nbytes
    return True


def joined(spans: list[Span]) -> np.ndarray:
    """The one buffer of spans that lie back to back (``adjacent``): a view, no copy."""
    if not adjacent(spans):
        raise ValueError("joined needs spans that lie back to back")
    return spans[0].base[spans[0].offset : spans[0].offset + sum(s.nbytes for s in spans)]


def join_flags(spans: list[Span]) -> list[bool]:
    """Per span: may it travel in one message with the span before it?"""
    flags = [False]
    for prev, cur in itertools.pairwise(spans):
        touching = (
            not (cur.pieces or prev.pieces)
            and cur.base is prev.base
            and prev.offset + prev.nbytes == cur.offset
        )
        flags.append(
            P.may_share(
                touching, prev.nbytes, cur.nbytes, scattered=bool(cur.pieces and prev.pieces)
            )
        )
    return flags


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(first page, first block, length)`` for each run of consecutive block ids (any
    ints: the paged cache's blocks, the places of a get's pages in its device rows)."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            page, first, length = runs[-1]
            runs[-1] = (page, first, length + 1)
        else:
            runs.append((i, block, 1))
    return runs
