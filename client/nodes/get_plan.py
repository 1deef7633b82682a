"""One frame of a same-host get's plan as arrays (``PlanPart``): where the node's
pinned pages lie in its slabs, which of them the client can copy, and the outcome of
the copies against the index's checksums. Built per plan frame by
``client.nodes.shm_connection``; arrays, not per-page objects, because a get of 64 KiB
pages names thousands."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from client.nodes.calls import Expected, GetOutcome


@dataclass(frozen=True, slots=True)
class PlanPart:
    """Pages of one plan frame, position by position: request position, size, the
    node's checksum, slab and offset in it."""

    present: np.ndarray
    sizes: np.ndarray
    checksums: np.ndarray
    regions: np.ndarray
    offsets: np.ndarray
    # set by ``kept``: the slabs of the frame (ascending) and each page's place among them
    slabs: np.ndarray | None = None
    slab_index: np.ndarray | None = None

    @classmethod
    def joined(cls, parts: Sequence[PlanPart]) -> PlanPart:
        """The pages of ``parts`` (at least one), in order, as one part."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate(arrays) for arrays in zip(*(p._arrays() for p in parts))))

    def kept(self, maps: dict[int, np.ndarray], sink_sizes: int | Sequence[int]) -> PlanPart:
        """The pages the client can copy: in a slab it has mapped, within it, and of
        their sink's size (any other can never be the page asked for): ``sink_sizes``
        per page, or one for all; with ``slabs`` and ``slab_index`` set."""
        slabs, index = np.unique(self.regions, return_inverse=True)
        index = index.reshape(-1)
        slab_bytes = np.array([getattr(maps.get(r), "size", 0) for r in slabs.tolist()])
        limits = slab_bytes[index] if len(index) else np.zeros(0, dtype=np.int64)
        sizes = self.sizes.astype(np.int64)
        keep = (sizes == np.asarray(sink_sizes, dtype=np.int64)) & (
            self.offsets.astype(np.int64) + sizes <= limits
        )
        present, sizes_, sums, regions, offsets = self._arrays()
        if not keep.all():
            present, sizes_, sums = present[keep], sizes_[keep], sums[keep]
            regions, offsets, index = regions[keep], offsets[keep], index[keep]
        return PlanPart(present, sizes_, sums, regions, offsets, slabs, index)

    def rows(self) -> Iterator[tuple[int, int, int, int]]:
        """Per page ``(request position, slab, offset, size)`` as Python ints."""
        return zip(
            self.present.tolist(),
            self.regions.tolist(),
            self.offsets.tolist(),
            self.sizes.tolist(),
        )

    def outcome(self, digests: Sequence[int] | np.ndarray, expected: Expected) -> GetOutcome:
        """The pages whose node checksum and landed bytes' digest both equal the
        index's (``expected``, by request position); the others count as corrupt."""
        want = np.asarray(expected, dtype=np.uint64)[self.present]
        good = (self.checksums == want) & (np.asarray(digests, dtype=np.uint64) == want)
        return GetOutcome(self.present[good].tolist(), int((~good).sum()))

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (self.present, self.sizes, self.checksums, self.regions, self.offsets)
