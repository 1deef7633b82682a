"""What a get into device memory copies (``client.memory.device_pages``), as arrays:
``PageCopies`` (pages of one size from host memory into one device tensor), the runs
of pages that lie back to back on both sides (one copy each), the rows they cover, and
which pages' checks are queued together (``check_batches``). Arrays, not per-page
objects: a get of 4,096 pages of 64 KiB spent about 10 us a page in per-page Python
(an H200 host, ``bench/gpu_check.py`` section 6), more than its copies took."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from client.memory.buffers import Span

if TYPE_CHECKING:
    from client.memory.device_rows import DeviceSpan
    from client.memory.layer_feed import LayerFeed

# Bytes of pages whose checks are queued together behind their copies: the device
# hashes one batch while the next crosses the bus, so a get waits after its last copy
# only for the checks of the last batch.
CHECK_BATCH = 32 << 20
LAST_CHECK_BATCH = 8 << 20


@dataclass(frozen=True, slots=True)
class PageCopies:
    """Pages of ``nbytes`` bytes each: page ``k`` goes from ``sources[src_index[k]]``
    at ``src_offsets[k]`` (a host uint8 array, contiguous) to ``dst`` (a flat uint8
    tensor on the device) at ``dst_offsets[k]``; landed layer by layer through ``feed``
    when one is set (``client.memory.layer_feed``)."""

    dst: torch.Tensor
    dst_offsets: np.ndarray
    sources: Sequence[np.ndarray]
    src_index: np.ndarray
    src_offsets: np.ndarray
    nbytes: int
    feed: LayerFeed | None = None

    @classmethod
    def of(cls, pairs: Sequence[tuple[DeviceSpan, Span]]) -> PageCopies:
        """Copies given page by page: ``(device span, host span)`` pairs, every device
        span of one tensor, every span of one size, every host span contiguous."""
        if not pairs:
            raise ValueError("no pages to copy")
        first = pairs[0][0]
        bases: dict[int, int] = {}
        sources: list[np.ndarray] = []
        index = np.empty(len(pairs), dtype=np.int64)
        for k, (dst, src) in enumerate(pairs):
            if dst.base is not first.base or dst.feed is not first.feed:
                raise ValueError("a device copy takes pages of one tensor and one feed")
            if src.pieces or src.nbytes != dst.nbytes or dst.nbytes != first.nbytes:
                raise ValueError("a device copy takes contiguous host spans of one page size")
            index[k] = bases.setdefault(id(src.base), len(bases))
            if index[k] == len(sources):
                sources.append(src.base)
        return cls(
            first.base,
            np.fromiter((d.offset for d, _ in pairs), dtype=np.int64, count=len(pairs)),
            sources,
            index,
            np.fromiter((s.offset for _, s in pairs), dtype=np.int64, count=len(pairs)),
            first.nbytes,
            first.feed,
        )

    def __len__(self) -> int:
        return len(self.dst_offsets)

    def source(self, k: int) -> Span:
        """Page ``k``'s host span."""
        return Span(self.sources[self.src_index[k]], int(self.src_offsets[k]), self.nbytes)

    def runs(self, start: int = 0, end: int | None = None) -> list[tuple[int, int, int, int]]:
        """The pages from ``start`` to ``end`` as runs that continue on both sides (the
        same source, back to back there and in ``dst``): per run ``(source, source
        offset, dst offset, pages)``, in order."""
        d, s, i = (a[start:end] for a in (self.dst_offsets, self.src_offsets, self.src_index))
        if not len(d):
            return []
        breaks = np.ones(len(d), dtype=bool)
        breaks[1:] = (
            (d[1:] != d[:-1] + self.nbytes) | (s[1:] != s[:-1] + self.nbytes) | (i[1:] != i[:-1])
        )
        firsts = np.flatnonzero(breaks)
        counts = np.diff(np.append(firsts, len(d)))
        return list(
            zip(i[firsts].tolist(), s[firsts].tolist(), d[firsts].tolist(), counts.tolist())
        )

    def views(
        self, start: int = 0, end: int | None = None
    ) -> list[tuple[torch.Tensor, np.ndarray]]:
        """``runs`` as the device and host views of each copy to make."""
        return [
            (self.dst[do : do + n * self.nbytes], self.sources[si][so : so + n * self.nbytes])
            for si, so, do, n in self.runs(start, end)
        ]

    def rows(self) -> list[int]:
        """The pages' places in ``dst``, counted in pages."""
        return (self.dst_offsets // self.nbytes).tolist()


def check_batches(count: int, nbytes: int) -> list[tuple[int, int]]:
    """The pages (``[start, end)`` of ``count`` pages of ``nbytes``) whose checks are
    queued together: consecutive pages of about ``CHECK_BATCH`` bytes, the last batch at
    most ``LAST_CHECK_BATCH`` (at least one page), since its checks are what a get waits
    for after its copies."""
    if count <= 1:
        return [(0, count)]
    tail = count - min(count - 1, max(1, LAST_CHECK_BATCH // nbytes))
    per = max(1, -(-CHECK_BATCH // nbytes))
    return [(k, min(k + per, tail)) for k in range(0, tail, per)] + [(tail, count)]
