"""Slab allocator for page slots of many sizes at once.

The pool is cut into equal slabs; a slab serves one size class of one owner (a
tenant: same-host clients map whole slabs, see server/pool.py). Size classes grow
geometrically (four per doubling above 64 KiB), so pages of different namespaces
of a tenant share slabs of their class, and a slab whose last slot is freed returns
to the common free list for any class and owner to take. Allocate and free are O(1)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

GRANULE = 4096


def size_class(nbytes: int) -> int:
    """Slot size used for a page of ``nbytes``: 4 KiB granules up to 64 KiB, then
    four classes per power of two (at most 25 % slack)."""
    if nbytes <= 0:
        raise ValueError(f"page size must be positive, got {nbytes}")
    size = -(-nbytes // GRANULE) * GRANULE
    if size <= 64 * 1024:
        return size
    step = 1 << (size.bit_length() - 3)
    return -(-size // step) * step


@dataclass(slots=True)
class _Slab:
    """One slab cut into slots of one size: hands out its slot numbers, freed ones first."""

    index: int
    slot_size: int
    slots: int
    owner: str
    bump: int = 0
    free: list[int] = field(default_factory=list)
    used: int = 0

    def take_slot(self) -> int:
        self.used += 1
        if self.free:
            return self.free.pop()
        self.bump += 1
        return self.bump - 1

    @property
    def full(self) -> bool:
        return self.used == self.slots


class SlabAllocator:
    """Hands out byte offsets into the pool. Not thread-safe: one event loop owns it."""

    def __init__(
        self,
        total_bytes: int,
        slab_size: int,
        on_new_slab: Callable[[int, str], None] | None = None,
        classify: Callable[[int], int] = size_class,
    ) -> None:
        if slab_size % GRANULE:
            raise ValueError(f"slab size {slab_size} must be a multiple of {GRANULE}")
        self.slab_size = slab_size
        self.num_slabs = total_bytes // slab_size
        self.capacity = self.num_slabs * slab_size
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self._slabs: dict[int, _Slab] = {}
        self._partial: dict[
            tuple[str, int], dict[int, _Slab]
        ] = {}  # (owner, class) -> slabs with free slots
        self._on_new_slab = on_new_slab  # told which owner a free slab now serves
        self.classify = (
            classify  # slot size for a page of n bytes (the disk tier's slots are exact)
        )
        self.used_bytes = 0

    def allocate(self, nbytes: int, owner: str = "") -> int | None:
        """Offset of a free slot for ``nbytes`` in a slab of ``owner``, or None when the
        owner's slabs of that class are full and no slab is free (the caller evicts and
        retries)."""
        cls = self.classify(nbytes)
        if cls > self.slab_size:
            raise ValueError(
                f"page of {nbytes} bytes exceeds the largest slot ({self.slab_size} bytes)"
            )
        partial = self._partial.setdefault((owner, cls), {})
        if partial:
            slab = partial[next(reversed(partial))]
        elif self._free_slabs:
            index = self._free_slabs[-1]
            if self._on_new_slab is not None:
                self._on_new_slab(index, owner)
            self._free_slabs.pop()
            slab = _Slab(index, cls, self.slab_size // cls, owner)
            self._slabs[index] = slab
            partial[index] = slab
        else:
            return None
        slot = slab.take_slot()
        if slab.full:
            del partial[slab.index]
        self.used_bytes += cls
        return slab.index * self.slab_size + slot * cls

    def free(self, offset: int) -> None:
        slab = self._slabs[offset // self.slab_size]
        slot, rem = divmod(offset - slab.index * self.slab_size, slab.slot_size)
        if rem:
            raise ValueError(f"offset {offset} is not the start of a slot")
        partial = self._partial[(slab.owner, slab.slot_size)]
        slab.used -= 1
        slab.free.append(slot)
        self.used_bytes -= slab.slot_size
        if slab.used == 0:
            partial.pop(slab.index, None)
            del self._slabs[slab.index]
            self._free_slabs.append(slab.index)
        else:
            partial[slab.index] = slab

    def restore_slab(self, index: int, slot_size: int, taken: list[int], owner: str = "") -> None:
        """Mark slots ``taken`` of free slab ``index`` (cut into ``slot_size`` slots) as
        used: recovery rebuilds the allocator from the records it finds on disk."""
        slab = _Slab(index, slot_size, self.slab_size // slot_size, owner)
        used = set(taken)
        slab.bump = slab.slots
        slab.free = [k for k in range(slab.slots - 1, -1, -1) if k not in used]
        slab.used = len(used)
        if not used:
            return
        self._free_slabs.remove(index)
        self._slabs[index] = slab
        self.used_bytes += slot_size * len(used)
        if not slab.full:
            self._partial.setdefault((owner, slot_size), {})[index] = slab

    @property
    def free_slabs(self) -> int:
        """Slabs serving no owner (any size class of any tenant may take them)."""
        return len(self._free_slabs)

    def slabs_of(self, owner: str, limit: int) -> list[int]:
        """Up to ``limit`` slabs serving ``owner``, those it took last first."""
        newest = (index for index, slab in reversed(self._slabs.items()) if slab.owner == owner)
        return [index for index, _ in zip(newest, range(limit))]

    def slot_size(self, offset: int) -> int:
        return self._slabs[offset // self.slab_size].slot_size

    def owner(self, offset: int) -> str:
        return self._slabs[offset // self.slab_size].owner
