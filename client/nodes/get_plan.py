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

    @classmethod
    def joined(cls, parts: Sequence[PlanPart]) -> PlanPart:
        """The pages of ``parts`` (at least one), in order, as one part."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate(arrays) for arrays in zip(*(p._arrays() for p in parts))))

    def kept(self, maps: dict[int, np.ndarray], sink_sizes: int | Sequence[int]) -> PlanPart:
        """The pages the client can copy: in a slab it has mapped, within it, and of
        their sink's size (any other can never be the page asked for): ``sink_sizes``
        per page, or one for all."""
        limits = np.zeros(len(self.regions), dtype=np.int64)  # 0: no mapping, nothing fits
        for region in np.unique(self.regions).tolist():
            mapped = maps.get(region)
            if mapped is not None:
                limits[self.regions == region] = mapped.size
        sizes = self.sizes.astype(np.int64)
        keep = (sizes == np.asarray(sink_sizes, dtype=np.int64)) & (
            self.offsets.astype(np.int64) + sizes <= limits
        )
        if keep.all():
            return self
        return PlanPart(*(a[keep] for a in self._arrays()))

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

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self.present, self.sizes, self.checksums, self.regions, self.offsets)
