"""Host memory that transfers reuse: the process's one pool of faulted-in arenas.

Fresh memory costs its page faults on first touch: 266 MB took 110 ms here (2.4 GB/s,
one 4 KiB fault at a time; MAP_POPULATE 82 ms, transparent huge pages up to 620 ms
when the kernel compacts), as long as the same-host transfer into it. So the buffers
a client fills and drops again come from arenas that stay: select's key/value
(returned to the pool when the caller drops them), packed runs of scattered pages for
UCX puts, the scratch of UCX gets, the staging of gets into device memory or merged
head groups, and the vLLM connector's page buffers (``client.paging.paged_cache.
StagingPool`` takes its pages here too: one pool per process, not one per consumer).

What is reserved (``reserve``: ``host_buffer_bytes`` at the first client's start, and
the connector's ``staging_bytes`` on top) is faulted in at once. Past it the pool
grows on demand, up to ``GROWTH`` times what was reserved, and keeps what it grew: a
caller that holds one ``select`` result while it asks for the next (``kv =
client.select(...)`` in a loop) needs twice a result's bytes, and would otherwise get
fresh memory and pay its faults on every call. A request past the bound gets fresh
memory, as before. Pinned where CUDA is."""

from __future__ import annotations

import bisect
import threading
import weakref

import numpy as np
import torch

ALIGN = 4096
# How far past what was reserved the pool may grow on demand, and keep (see the module
# docstring). Twice: room for one select result held while the next one lands.
GROWTH = 2
# Smallest arena a miss grows the pool by (capped by the bound), so that small scratch
# requests do not each add an arena; faulted in by whoever touches it first.
GROW_STEP = 64 << 20


class HostBuffers:
    """First-fit blocks of a few arenas, coalesced when given back; grows to a bound and
    keeps what it grew. Any thread may call it (select's tensors return from whichever
    thread drops them). Callers: the client (``reserve`` at start; ``take``/``give``
    for scratch and staging, ``lend`` for select's results), the connection's packing
    and scratch, the connector's ``StagingPool`` (``reserve``, ``try_take_buffer``)."""

    def __init__(self, growth: float = GROWTH, grow_step: int = GROW_STEP) -> None:
        self._lock = threading.Lock()
        self._arenas: list[np.ndarray] = []
        self._free: list[tuple[int, int, int]] = []  # (address, size, arena), sorted by address
        self._taken: dict[
            int, tuple[int, int]
        ] = {}  # address -> (size, arena) of blocks handed out
        self._growth = growth
        self._grow_step = grow_step
        self._shares: dict[str, int] = {}  # what each share reserved (``reserve``)
        self.reserved = 0  # bytes the shares reserved in all: faulted in at once
        self.held = 0  # bytes of every arena: what was reserved and what the pool grew
        self.fresh_takes = 0  # takes that found no room up to the bound and got fresh memory

    @property
    def limit(self) -> int:
        """The most the arenas may hold in all (``GROWTH`` times what was reserved)."""
        return int(self.reserved * self._growth)

    def reserve(self, nbytes: int, share: str = "clients") -> None:
        """Reserve ``nbytes`` for ``share``, faulted in now. Within a share the largest
        value asked for wins (the clients of a process, each starting with its
        ``host_buffer_bytes``; a connector worker made again in the same process); the
        shares add up (the connector's page buffers, ``staging_bytes``, on top of its
        client's)."""
        with self._lock:
            self._shares[share] = max(self._shares.get(share, 0), nbytes)
            self.reserved = sum(self._shares.values())
            grow = self.reserved - self.held
            if grow < ALIGN:
                return
            self.held += grow
        self._new_arena(grow, fault=True)

    def take_buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of host memory (uint8): a pooled block when one fits or the pool
        may grow to hold it, else fresh memory. Give it back with ``give`` once nothing
        can write into it."""
        block = self.try_take_buffer(nbytes)
        return np.empty(nbytes, dtype=np.uint8) if block is None else block

    def try_take_buffer(self, nbytes: int) -> np.ndarray | None:
        """``take``, or None where it would get fresh memory (a caller whose fresh
        memory must be of another kind: pinned staging for a device)."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            block = self._carve(size, nbytes)
            if block is not None:
                return block
            grow = min(max(size, self._grow_step), self.limit - self.held)
            if grow < size:
                self.fresh_takes += 1
                return None
            self.held += grow  # counted now, so that threads growing at once stay under the bound
        return self._new_arena(grow, fault=False, keep=size)[:nbytes]

    def give_buffer(self, buf: np.ndarray | torch.Tensor) -> None:
        """Return a block ``take`` gave (fresh memory is left to the garbage collector).
        Never for a buffer a cancelled transfer may still be landing in."""
        addr = buf.data_ptr() if isinstance(buf, torch.Tensor) else buf.ctypes.data
        self._give_address(addr)

    def lend(self, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over a block that returns to the pool once the caller has dropped
        it and every view of it (select's key and value)."""
        block = self.take_buffer(nbytes)
        owner = block.view()  # only torch holds this object, so it dies with the last view
        weakref.finalize(owner, self._give_address, owner.ctypes.data)
        return torch.from_numpy(owner).view(dtype).view(shape)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size, _ in self._free)

    def _new_arena(self, nbytes: int, *, fault: bool, keep: int = 0) -> np.ndarray:
        """Allocate an arena (outside the lock: pinning and faulting take a while) and
        free all of it but its first ``keep`` bytes, which the caller takes."""
        arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()).numpy()
        if fault:
            arena[::ALIGN] = 0  # one write per page faults the arena in
        with self._lock:
            self._arenas.append(arena)
            index = len(self._arenas) - 1
            if keep:
                self._taken[arena.ctypes.data] = (keep, index)
            if nbytes > keep:
                self._insert(arena.ctypes.data + keep, nbytes - keep, index)
        return arena

    def _carve(self, size: int, nbytes: int) -> np.ndarray | None:
        """The first free block that holds ``size`` bytes, cut to ``nbytes`` (lock held)."""
        for k, (addr, free, arena) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[k]
                else:
                    self._free[k] = (addr + size, free - size, arena)
                self._taken[addr] = (size, arena)
                base = self._arenas[arena]
                off = addr - base.ctypes.data
                return base[off : off + nbytes]
        return None

    def _give_address(self, addr: int) -> None:
        with self._lock:
            taken = self._taken.pop(addr, None)
            if taken is not None:
                self._insert(addr, *taken)

    def _insert(self, addr: int, size: int, arena: int) -> None:
        """Add a free block, merged with free neighbours in the same arena."""
        k = bisect.bisect(self._free, (addr,))
        if k < len(self._free) and self._free[k][2] == arena and addr + size == self._free[k][0]:
            size += self._free.pop(k)[1]
        if (
            k > 0
            and self._free[k - 1][2] == arena
            and self._free[k - 1][0] + self._free[k - 1][1] == addr
        ):
            addr, prev, _ = self._free.pop(k - 1)
            size += prev
            k -= 1
        self._free.insert(k, (addr, size, arena))


_pool = HostBuffers()


def host_buffers() -> HostBuffers:
    """The process's pool (every client of a process and the connector share it)."""
    return _pool
