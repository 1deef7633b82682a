"""The storage node's page memory: one anonymous mapping of ``capacity`` bytes.

Allocated once at start, page-aligned (mmap), backed by hugetlbfs pages when the
kernel has some reserved, else by transparent huge pages via madvise."""

from __future__ import annotations

import logging
import mmap

import numpy as np

log = logging.getLogger(__name__)
_MAP_HUGETLB = 0x40000


class MemoryPool:
    """Owns the mapping; ``view(offset, size)`` returns a writable numpy uint8 view."""

    def __init__(self, capacity: int, hugepages: bool = True) -> None:
        self.capacity = capacity
        self.backing = "4k"
        self._map: mmap.mmap | None = None
        if hugepages:
            try:
                flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB
                self._map = mmap.mmap(-1, capacity, flags=flags)
                self.backing = "hugetlb"
            except OSError:
                self._map = None
        if self._map is None:
            self._map = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    self._map.madvise(mmap.MADV_HUGEPAGE)
                    self.backing = "thp"
                except OSError:
                    pass
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        log.info("memory pool: %d bytes, backing %s", capacity, self.backing)

    def view(self, offset: int, size: int) -> np.ndarray:
        return self.array[offset : offset + size]
