"""``SlabMaps``: one same-host connection's mappings of its node's slabs, and the
device copier's registration of each (``client.nodes.shm_connection``)."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from client.memory.device_landing import DeviceLanding
from client.memory.device_pages import DeviceCopier
from kvstore.errors import ProtocolError
from kvstore.wire import shm

# Mapping a slab the client has not seen costs page-table work before the first copy.
# Measured on a 64 MiB memfd slab (kernel 6.18, shmem without huge pages): MAP_POPULATE
# 5-6.6 ms; no populate and faults during the copy +2.8 ms (reads, which the kernel's
# fault-around maps 16 pages at a time) or +19 ms (writes, a fault per 4 KiB page);
# reading one byte per 64 KiB first 2.5-3 ms, after which reads and writes copy at full
# speed (shmem maps its pages writable on a read fault). In a put of 64 MiB into a fresh
# slab the mapping step fell from 5.6 to 2.5-2.8 ms (of about 25 ms); a steady client
# maps each slab of its tenant once and keeps it.
FAULT_AROUND = 64 << 10


class SlabMaps:
    """Slab index -> its mapping (writable once a put lent it; the node tracks
    generations), and the device's registration of a mapping, made by the first device
    get that reads from it and undone before the mapping goes. Used on the client's
    event loop; ``release`` also from a connection's finalizer."""

    def __init__(self, node_id: str, device: DeviceCopier | None) -> None:
        self.node_id = node_id
        self.device = device
        self.views: dict[int, np.ndarray] = {}
        self.registered: dict[int, Any] = {}

    def map(self, mapped: list[tuple[int, int]], fds: list[int]) -> None:
        """Map the slabs whose descriptors came with a plan (replacing stale generations
        and read-only mappings of slabs now lent for writing); the descriptors are
        closed, the mappings stay."""
        try:
            if len(mapped) != len(fds):
                raise ProtocolError(
                    f"node {self.node_id} sent {len(fds)} descriptors for {len(mapped)} slabs"
                )
            for (region, _generation), fd in zip(mapped, fds):
                size = os.fstat(fd).st_size
                writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                view = np.frombuffer(
                    mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot), dtype=np.uint8
                )
                int(view[::FAULT_AROUND].sum())  # one read per 64 KiB maps the slab
                self._unregister(region)  # the mapping it replaces goes now
                self.views[region] = view
        finally:
            shm.close_fds(fds)

    def registered_views(self) -> dict[int, np.ndarray]:
        """The mappings a device get has registered (through a plan): slot reads read
        only these (``client.nodes.slot_reads``)."""
        return {r: self.views[r] for r in self.registered if r in self.views}

    def for_device(self, region: int, device: DeviceCopier) -> np.ndarray | None:
        """Slab ``region``'s mapping, registered with ``device`` (once); None if unmapped."""
        view = self.views.get(region)
        if view is not None and region not in self.registered:
            self.registered[region] = device.register(view, view.flags.writeable)
        return view

    def _unregister(self, region: int) -> None:
        token = self.registered.pop(region, None)
        if token is not None and self.device is not None:
            self.device.unregister(token)

    def release(self, landing: Sequence[DeviceLanding] = ()) -> None:
        """Undo every registration, once no copy of a get in flight (``landing``) can
        still read them, and drop the mappings."""
        for unfinished in landing:
            unfinished.settle()
        for region in list(self.registered):
            self._unregister(region)
        self.views.clear()
