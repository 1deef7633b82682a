"""Gets into device memory: the seam between a client's connections and an accelerator's
memory (``DeviceCopier``), its CUDA form (``CudaCopier``) and a host stand-in
(``HostCopier``: the same path with the CPU as the "device", for tests and CPU checks).

The path, on the same host: a node's pool slabs are mapped read-only into the client
(``client.nodes.shm_connection``); each mapping is registered with CUDA once, when a device
get first reads from it (``cudaHostRegister``, read-only flag for read-only mappings),
so that a page is copied from the node's memory straight into device memory by DMA:
no CPU copy, no CPU hash. Every page that landed is then checked on the device against
the index's checksum (``kvstore.pages.device_checksum``: the same xxh3), after the copy
is complete and the node was told it may unpin, so a page evicted, overwritten or
scribbled on while it was copied fails its check and is a miss, never wrong KV. A get
lands part by part as its plan arrives, through a ``DeviceLanding`` the copier makes for it
(``client.memory.device_landing``).

Measured on an NVIDIA H200 (``../shared/reference/gpu-h200.md``): an H2D copy from an
unregistered ``/dev/shm`` mapping ran at 6.0-6.2 GB/s, from a registered one at 54.2
(read-only registration 54.5), the pinned-buffer limit being 54.4; 128 separate 2 MiB
copies 50.2-50.5. So copies of pages that lie back to back in a slab, to rows that lie
back to back, are merged into one (``client.memory.copy_plans``).

A mapping whose registration fails still works (the copy is then the driver's staged
one, about 6 GB/s): the failure is logged once per copier and counted
(``ClientStats.host_register_failures``), never silent. Across hosts, UCX receives
into the client's pinned host buffers (checked there as it lands), and the verified
pages are copied to the device (``client.nodes.connection``)."""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import numpy as np
import torch

from client.memory.copy_plans import PageCopies
from client.memory.cudart import Memcpy2D, clear_last_error
from client.memory.device_landing import (
    BusPace,
    CudaLanding,
    DeviceLanding,
    HostLanding,
    host_copies,
    settled,
)
from client.memory.device_rows import DeviceRows
from client.memory.layer_feed import LayerFeed
from client.stats import ClientStats
from kvstore.pages import device_checksum

log = logging.getLogger(__name__)
# cudaHostRegister's flags (driver_types.h): read-only mappings need the read-only flag
# (measured: PROT_READ /dev/shm mapping with flag 8 reached 54.5 GB/s on an H200).
REGISTER_DEFAULT = 0
REGISTER_READ_ONLY = 8


class DeviceCopier:
    """What a client needs of a device to land pages there: register host mappings,
    copy host bytes into device spans, checksum device spans. Built once per client and
    handed to its connections at construction; called on the client's event loop.
    ``stats``: the client's counters (registrations and their failures)."""

    def __init__(self, device: torch.device, stats: ClientStats) -> None:
        self.device = device
        self.stats = stats

    def supports(self, page_nbytes: int) -> bool:
        """Whether pages of this size can land through this copier (else: staged)."""
        return True

    def lands_layers(self) -> bool:
        """Whether gets can land layer by layer (``DeviceSpan.feed``) here."""
        return True

    def register(self, mapping: np.ndarray, writable: bool) -> Any:
        """Make ``mapping`` (a whole slab) a fast copy source; returns a token for
        ``unregister`` (None when it stays unregistered)."""
        return None

    def unregister(self, token: Any) -> None:
        """Undo ``register`` before the mapping goes away."""

    def wait_for(self, event: Any) -> None:
        """Copies queued from now on start once ``event`` (a device event) has passed:
        a get into memory that earlier device work may still read (a paged cache's
        blocks freed by the step before). The host's copies are made at once: nothing
        to wait for."""

    def landing(self, rows: DeviceRows) -> DeviceLanding:
        """A get's landing in ``rows``, checked page by page (``client.memory.device_landing``)."""
        raise NotImplementedError

    async def land(self, copies: PageCopies) -> None:
        """Copy each page of ``copies`` from host memory (pages checked there already:
        a get over UCX) into the device tensor; returns once every byte has landed."""
        raise NotImplementedError


class HostCopier(DeviceCopier):
    """The device path with host memory as the "device": the same connection code,
    registrations (none needed) and checks, with copies by torch and digests by xxhash.
    Used where no GPU is (tests of the path) and as the reference ``CudaCopier`` is
    checked against."""

    def __init__(self, stats: ClientStats) -> None:
        super().__init__(torch.device("cpu"), stats)

    def landing(self, rows: DeviceRows) -> DeviceLanding:
        return HostLanding(rows)

    async def land(self, copies: PageCopies) -> None:
        host_copies(copies)


class CudaCopier(DeviceCopier):
    """Copies on a CUDA stream of its own from host mappings registered with CUDA, and
    checks on the device (``kvstore.pages.device_checksum``). ``supports`` says whether
    the checks run here (Triton present and its digests equal xxhash's): a client uses
    the device path only then, and stages through pinned host memory otherwise."""

    def __init__(self, device: torch.device, stats: ClientStats) -> None:
        if device.index is None:  # "cuda": the current device, named
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device, stats)
        self._lock = threading.Lock()
        self._prepared = False
        self._stream: Any = None  # the copies
        self._checks: Any = None  # the checks of what landed
        self._cudart: Any = None
        self._register_warned = False
        self.unusable: str | None = None  # why the device checks cannot run (``prepare``)
        self.unusable_layers: str | None = None  # why gets cannot land layer by layer
        self._memcpy_2d: Any = None
        self.pace = BusPace()  # how fast its landings have gone (when to wait for the next)

    def prepare(self) -> None:
        """Make the copy stream and check the device checksums against xxhash
        (compiling Triton's kernels: seconds, once per process and device). ``supports``
        calls it: the vLLM connector's first ``lands_on_device``, at registration, pays
        for it, not its first load. Any thread."""
        if self._prepared:  # every get asks supports: no lock once done
            return
        with self._lock:
            if self._prepared:
                return
            self._stream = torch.cuda.Stream(device=self.device)
            self._checks = torch.cuda.Stream(device=self.device)
            self._cudart = torch.cuda.cudart()
            try:
                self._memcpy_2d = Memcpy2D()
            except (OSError, AttributeError) as exc:  # no runtime found: no layer-wise gets
                self.unusable_layers = f"no cudaMemcpy2DAsync: {exc}"
            with torch.cuda.device(self.device):
                self.unusable = device_checksum.self_test(self.device)
            if self.unusable:
                log.warning(
                    "gets into %s go through pinned host memory: %s", self.device, self.unusable
                )
            self._prepared = True

    def supports(self, page_nbytes: int) -> bool:
        self.prepare()
        return self.unusable is None and device_checksum.supports(page_nbytes)

    def lands_layers(self) -> bool:
        self.prepare()
        return self.unusable_layers is None

    def register(self, mapping: np.ndarray, writable: bool) -> Any:
        ptr, size = mapping.ctypes.data, mapping.nbytes
        flags = REGISTER_DEFAULT if writable else REGISTER_READ_ONLY
        err = int(self._cudart.cudaHostRegister(ptr, size, flags))
        if err and not writable:  # a driver without read-only registration: plain flags
            err = int(self._cudart.cudaHostRegister(ptr, size, REGISTER_DEFAULT))
        if err:
            clear_last_error(self._cudart)  # else torch's next launch check raises it
            self.stats.host_register_failures += 1
            if not self._register_warned:
                self._register_warned = True
                log.warning(
                    "cudaHostRegister of a node's %d-byte slab failed (error %d): pages from "
                    "unregistered slabs are copied at pageable speed (logged once; counted in "
                    "host_register_failures)",
                    size,
                    err,
                )
            return None
        self.stats.host_registrations += 1
        return ptr

    def unregister(self, token: Any) -> None:
        if token is not None and int(self._cudart.cudaHostUnregister(token)):
            clear_last_error(self._cudart)  # else torch's next launch check raises it

    def wait_for(self, event: Any) -> None:
        self.prepare()
        self._stream.wait_event(event)

    @property
    def copy_stream(self) -> Any:
        """The stream the copies run on (``client.memory.device_landing``)."""
        return self._stream

    @property
    def checks(self) -> Any:
        """The stream the pages' checks run on (``client.memory.device_landing``)."""
        return self._checks

    def landing(self, rows: DeviceRows) -> DeviceLanding:
        return CudaLanding(self, rows)

    async def land(self, copies: PageCopies) -> None:
        feed = copies.feed
        await settled(
            self.queue_copies(copies) if feed is None else self.queue_layers(copies, feed)
        )

    def queue_copies(self, copies: PageCopies, start: int = 0, end: int | None = None) -> Any:
        """Queue the copies of pages ``start`` to ``end`` on the copy stream, one per run
        of pages that lie back to back on both sides; the event after them."""
        stream = self._stream
        if self._memcpy_2d is None:  # no runtime of our own to call: torch's copies
            with warnings.catch_warnings(), torch.cuda.stream(stream):
                warnings.simplefilter("ignore", UserWarning)  # a read-only mapping: only read
                for dst, src in copies.views(start, end):
                    dst.copy_(torch.from_numpy(src), non_blocking=True)
        else:  # one runtime call a run (torch's copy_ costs tens of us of Python each)
            base, page = copies.dst.data_ptr(), copies.nbytes
            with torch.cuda.device(self.device):  # the runtime call acts on the current device
                for si, so, do, n in copies.runs(start, end):
                    host = copies.sources[si].ctypes.data + so
                    self._memcpy_2d.copy(base + do, host, n * page, stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @property
    def segments(self) -> bool:
        """Whether pages can land in segments (``queue_segment``: 2-D copies)."""
        return self._memcpy_2d is not None

    def queue_segment(self, copies: PageCopies, at: int, width: int) -> Any:
        """Queue bytes ``at`` to ``at + width`` of every page of ``copies`` on the copy
        stream, one 2-D copy per run of pages (``client.memory.device_landing.segments``);
        the event after them."""
        page, stream = copies.nbytes, self._stream
        base = copies.dst.data_ptr()
        with torch.cuda.device(self.device):  # the runtime call acts on the current device
            for si, so, do, n in copies.runs():
                src = copies.sources[si].ctypes.data + so
                self._memcpy_2d(base + do + at, page, src + at, page, width, n, stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def queue_layers(self, copies: PageCopies, feed: LayerFeed) -> Any:
        """Queue a layer-wise landing: per layer, one 2-D copy per run of pages (that
        layer's slice of each page), then an event handed to ``feed``; the last one."""
        page, stream = copies.nbytes, self._stream
        width, rows = page // feed.layers, copies.rows()
        runs = [
            (copies.dst.data_ptr() + do, copies.sources[si].ctypes.data + so, n)
            for si, so, do, n in copies.runs()
        ]
        event = None
        with torch.cuda.device(self.device):  # the runtime call acts on the current device
            for layer in range(feed.layers):
                at = layer * width
                for dst, src, n in runs:
                    self._memcpy_2d(dst + at, page, src + at, page, width, n, stream.cuda_stream)
                event = torch.cuda.Event()
                event.record(stream)
                feed.queued(layer, rows, event)
        return event


def default_copier(stats: ClientStats) -> DeviceCopier | None:
    """The copier a client builds for itself: CUDA's where a GPU is, else None (gets into
    device memory then stage through pinned host memory, as without one)."""
    if not torch.cuda.is_available():
        return None
    return CudaCopier(torch.device("cuda", torch.cuda.current_device()), stats)
