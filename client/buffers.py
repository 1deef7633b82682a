"""Byte spans over host memory that pages are sent from and received into.

A span is a slice of a flat uint8 array. Spans that sit back to back in one array
travel as a single UCX message without a copy; others are packed (send) or landed
in a scratch buffer and scattered (receive)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstore.wire import protocol as P


@dataclass(frozen=True, slots=True)
class Span:
    base: np.ndarray
    offset: int
    nbytes: int

    def view(self) -> np.ndarray:
        return self.base[self.offset : self.offset + self.nbytes]


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
        if s.base is not first.base or s.offset != pos:
            return False
        pos += s.nbytes
    return True


def joined(spans: list[Span]) -> np.ndarray:
    """One buffer holding the spans in order: a view when adjacent, else a packed copy."""
    if adjacent(spans):
        return spans[0].base[spans[0].offset : spans[0].offset + sum(s.nbytes for s in spans)]
    return np.concatenate([s.view() for s in spans])


def join_flags(spans: list[Span]) -> list[bool]:
    """Per span: may it travel in one message with the span before it?"""
    flags = [False]
    for prev, cur in zip(spans, spans[1:]):
        touching = cur.base is prev.base and prev.offset + prev.nbytes == cur.offset
        flags.append(P.may_share(touching, prev.nbytes, cur.nbytes))
    return flags
