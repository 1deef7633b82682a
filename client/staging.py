"""Host memory that transfers reuse: one process-wide pool of faulted-in arenas.

Fresh memory costs its page faults on first touch: 266 MB took 110 ms here (2.4 GB/s,
one 4 KiB fault at a time; MAP_POPULATE 82 ms, transparent huge pages up to 620 ms
when the kernel compacts), as long as the same-host transfer into it. So the buffers
a client fills and drops again come from arenas faulted in once, at the first client's
start (``host_buffer_bytes``): select's key/value (returned to the pool when the
caller drops them), packed runs of scattered pages for UCX puts, the scratch of UCX
gets, and the staging of gets into device memory or merged head groups. A request the
free arena space cannot hold gets fresh memory, as before. Pinned where CUDA is."""

from __future__ import annotations

import bisect
import threading
import weakref

import numpy as np
import torch

ALIGN = 4096


class HostBuffers:
    """First-fit blocks of a few arenas, coalesced when given back. Any thread may call
    it (select's tensors return from whichever thread drops them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arenas: list[np.ndarray] = []
        self._free: list[tuple[int, int, int]] = []  # (address, size, arena), sorted by address
        self._taken: dict[int, int] = {}  # address -> size of blocks handed out
        self.reserved = 0

    def reserve(self, nbytes: int) -> None:
        """Grow the arenas to ``nbytes`` in all, faulted in now (client start)."""
        with self._lock:
            grow = nbytes - self.reserved
            if grow < ALIGN:
                return
            self.reserved += grow
        arena = torch.empty(grow, dtype=torch.uint8, pin_memory=torch.cuda.is_available()).numpy()
        arena[::ALIGN] = 0  # one write per page faults the arena in
        with self._lock:
            self._arenas.append(arena)
            self._insert(arena.ctypes.data, arena.nbytes, len(self._arenas) - 1)

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of host memory (uint8): free arena space when a block fits, else
        fresh memory. Give it back with ``give`` once nothing can write into it."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            for k, (addr, free, arena) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[k]
                    else:
                        self._free[k] = (addr + size, free - size, arena)
                    self._taken[addr] = size
                    base = self._arenas[arena]
                    off = addr - base.ctypes.data
                    return base[off : off + nbytes]
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf: np.ndarray | torch.Tensor) -> None:
        """Return a block ``take`` gave (fresh memory is left to the garbage collector).
        Never for a buffer a cancelled transfer may still be landing in."""
        addr = buf.data_ptr() if isinstance(buf, torch.Tensor) else buf.ctypes.data
        self._give_address(addr)

    def lend(self, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over a block that returns to the pool once the caller has dropped
        it and every view of it (select's key and value)."""
        block = self.take(nbytes)
        owner = block.view()  # only torch holds this object, so it dies with the last view
        weakref.finalize(owner, self._give_address, owner.ctypes.data)
        return torch.from_numpy(owner).view(dtype).view(shape)

    def _give_address(self, addr: int) -> None:
        with self._lock:
            size = self._taken.pop(addr, None)
            if size is None:
                return
            arena = next(i for i, a in enumerate(self._arenas) if a.ctypes.data <= addr < a.ctypes.data + a.nbytes)
            self._insert(addr, size, arena)

    def _insert(self, addr: int, size: int, arena: int) -> None:
        """Add a free block, merged with free neighbours in the same arena."""
        k = bisect.bisect(self._free, (addr,))
        if k < len(self._free) and self._free[k][2] == arena and addr + size == self._free[k][0]:
            size += self._free.pop(k)[1]
        if k > 0 and self._free[k - 1][2] == arena and self._free[k - 1][0] + self._free[k - 1][1] == addr:
            addr, prev, _ = self._free.pop(k - 1)
            size += prev
            k -= 1
        self._free.insert(k, (addr, size, arena))

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size, _ in self._free)


_pool = HostBuffers()


def host_buffers() -> HostBuffers:
    """The process's pool (every client of a process shares it)."""
    return _pool
