"""One get's landing in device rows (``DeviceLanding``), part by part as its plan arrives:
each part's copies are queued at once and its pages' checks behind them; the digests
of every page come once, at the end. Made by a ``DeviceCopier`` (``landing``) for
``client.nodes.shm_connection``; ``CudaLanding`` on a GPU, ``HostLanding`` with the host
as the "device" (tests, CPU checks).

The state a get shares across its parts lives here, so a part costs its copies and
one launch of the checks: the rows' offsets go to the device once per get, the
checks of every part write one tensor of accumulators, and one download brings them
back. Measured on an H200 (``bench/gpu_check.py`` section 6, 2 MiB pages): with an
upload, two check launches and a synchronous download per part of 32 MiB, each part
cost the client's loop about 0.8 ms, more than its copies took (0.6 ms)."""

from __future__ import annotations

import asyncio
import collections
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from client.memory.copy_plans import CHECK_BATCH, PageCopies, check_batches
from kvstore.pages import device_checksum
from kvstore.pages.checksum import page_checksum

if TYPE_CHECKING:
    from client.memory.device_rows import DeviceRows
    from client.memory.layer_feed import LayerFeed


class StreamCopier(Protocol):
    """What a ``CudaLanding`` asks of its copier (``CudaCopier``,
    client/memory/device_pages.py): its device and streams, queued copies (each call
    returns an event the part's checks wait on), and the pace of earlier landings."""

    device: torch.device
    pace: BusPace

    @property
    def copy_stream(self) -> Any: ...

    @property
    def checks(self) -> Any: ...

    def queue_copies(self, copies: PageCopies, start: int = 0, end: int | None = None) -> Any: ...

    def queue_layers(self, copies: PageCopies, feed: LayerFeed) -> Any: ...

    @property
    def segments(self) -> bool: ...

    def queue_segment(self, copies: PageCopies, at: int, width: int) -> Any: ...


class DeviceLanding:
    """Pages landing in ``rows`` (a get's sinks, by request position): ``add`` queues a
    part's copies and checks, ``digests`` waits for every one and gives each page's
    xxh3-64 of the bytes that landed, ``settle`` blocks until no copy can still land
    (for a caller giving up). Used on the client's event loop only."""

    def __init__(self, rows: DeviceRows) -> None:
        self.rows = rows
        self.added = np.zeros(len(rows), dtype=bool)

    def add(self, positions: np.ndarray, copies: PageCopies) -> None:
        """Land the pages of ``copies``, the rows at ``positions`` (ascending, each at
        most once per get): ``copies.dst_offsets`` are those rows' offsets."""
        raise NotImplementedError

    async def digests(self) -> np.ndarray:
        """Per row (uint64), the digest of what landed there; 0 where nothing was added.
        Every byte has landed once this returns."""
        raise NotImplementedError

    def settle(self) -> None:
        """Block until no copy of this landing can still land."""


class HostLanding(DeviceLanding):
    """Copies made at once by torch, digests by xxhash: the CUDA path's stand-in."""

    def add(self, positions: np.ndarray, copies: PageCopies) -> None:
        self.added[positions] = True
        host_copies(copies)

    async def digests(self) -> np.ndarray:
        flat, page = self.rows.base.numpy(), self.rows.nbytes
        out = np.zeros(len(self.rows), dtype=np.uint64)
        for k in np.flatnonzero(self.added).tolist():
            at = int(self.rows.offsets[k])
            out[k] = page_checksum(flat[at : at + page])
        return out


class CudaLanding(DeviceLanding):
    """Copies on the copier's copy stream, each part's checks on its check stream
    behind them (in batches of about ``CHECK_BATCH`` within a large part), into one
    tensor of accumulators by row; one download at the end."""

    def __init__(self, copier: StreamCopier, rows: DeviceRows) -> None:
        super().__init__(rows)
        self._copier = copier
        self._words: torch.Tensor | None = None  # the rows' offsets, in 8-byte words
        self._accs: torch.Tensor | None = None  # [rows, 8]: the checks of parts that are ranges
        self._scattered: list[tuple[np.ndarray, torch.Tensor]] = []  # the other parts' rows, accs
        self._checked: Any = None  # after the last part's checks
        self._sources: list[Sequence[np.ndarray]] = []  # held until no copy reads them
        self._started = 0.0  # when the first copy was queued
        self._start: Any = None  # on the copy stream before it (timed)
        self._bytes = 0

    def add(self, positions: np.ndarray, copies: PageCopies) -> None:
        copier, page, n = self._copier, copies.nbytes, len(positions)
        if self._start is None:
            self._started = time.perf_counter()
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(copier.copy_stream)
        self._bytes += n * page
        self.added[positions] = True
        self._sources.append(copies.sources)
        # per batch of pages: its first and end page, the event after its copies, and the
        # blocks of each page it covers (None: whole pages)
        landed: list[tuple[int, int, Any, tuple[int, int] | None]]
        if copies.feed is not None:  # one batch, after the last layer
            landed = [(0, n, copier.queue_layers(copies, copies.feed), None)]
        elif page > SEGMENT_BYTES and copier.segments:
            landed = [
                (0, n, copier.queue_segment(copies, at, width), blocks)
                for at, width, blocks in segments(page)
            ]
        else:
            batches = [(0, n)] if n * page <= CHECK_BATCH else check_batches(n, page)
            landed = [(a, b, copier.queue_copies(copies, a, b), None) for a, b in batches]
        checks = copier.checks
        with torch.cuda.stream(checks):
            if self._words is None or self._accs is None:
                self._words = device_checksum.word_offsets(self.rows.offsets, page, copier.device)
                self._accs = torch.empty(
                    (len(self.rows), 8), dtype=torch.int64, device=copier.device
                )
            accs_by_row = self._accs
            first = int(positions[0])
            # a part's rows are a range, unless the node lacked a page of it
            ranged = int(positions[-1]) - first + 1 == n
            if ranged:
                words = self._words[first : first + n]
            else:
                words = device_checksum.word_offsets(copies.dst_offsets, page, copier.device)
            # a part's pages checked in segments share one tensor of accumulators
            if not ranged and landed[0][3] is not None:
                accs = torch.empty((n, 8), dtype=torch.int64, device=copier.device)
                self._scattered.append((positions, accs))
            for a, b, event, blocks in landed:
                checks.wait_event(event)
                if ranged:
                    out = accs_by_row[first + a : first + b]
                    device_checksum.launch(self.rows.base, words[a:b], page, out, blocks)
                elif blocks is not None:
                    device_checksum.launch(self.rows.base, words, page, accs, blocks)
                else:
                    accs = device_checksum.launch(self.rows.base, words[a:b], page)
                    self._scattered.append((positions[a:b], accs))
            self._checked = torch.cuda.Event()
            self._checked.record(checks)

    async def digests(self) -> np.ndarray:
        if self._accs is None:
            return np.zeros(len(self.rows), dtype=np.uint64)
        page, checks = self.rows.nbytes, self._copier.checks
        with torch.cuda.stream(checks):  # behind every check, off the default stream
            host = [_download(self._accs)] + [_download(accs) for _, accs in self._scattered]
            done = torch.cuda.Event(enable_timing=True)
            done.record(checks)
        # A get landing layer by layer is waited for in a thread: the forward runs beside
        # it, and its thread would share the interpreter with a loop asking every turn.
        pace = self._copier.pace
        polled = self.rows.feed is None
        await settled(done, pace.end(self._started, self._bytes) if polled else None)
        if polled:  # the device's own time: a wait that overslept must not teach a slower pace
            pace.measured(self._bytes, self._start.elapsed_time(done) / 1e3)
        digests = device_checksum.merge(host[0].numpy().view(np.uint64), page)
        for (positions, _), got in zip(self._scattered, host[1:]):
            digests[positions] = device_checksum.merge(got.numpy().view(np.uint64), page)
        digests[~self.added] = 0
        self._sources.clear()
        return digests

    def settle(self) -> None:
        """Both streams, whole: a part whose ``add`` failed half way has no event of
        its own, and may have copies queued."""
        if self._sources:
            self._copier.copy_stream.synchronize()
            self._copier.checks.synchronize()
            self._sources.clear()


# Pages larger than this land and are checked in segments of this size, each page's
# check resuming where the segment before left it: xxh3 chains a page's 1 KiB blocks one
# after another, so a whole 16 MiB page's check ran about 0.8 ms after its last byte
# landed (H200: the device xxh3 of 256 MiB took 1.36 ms as 16 MiB pages, 0.60 ms as
# 2 MiB pages; a 16 MiB get 8.04 ms against 6.44 ms for 2 MiB pages). In segments the
# last one's check is a 2 MiB page's.
SEGMENT_BYTES = 2 << 20


def segments(page: int) -> list[tuple[int, int, tuple[int, int]]]:
    """A page of ``page`` bytes as ``SEGMENT_BYTES`` segments: per segment, its first
    byte, its width, and the xxh3 blocks (``device_checksum.launch``'s ``blocks``) its
    check covers, the last segment's up to the end of the page."""
    tail, block = device_checksum.full_blocks(page), device_checksum.BLOCK
    out = []
    for at in range(0, page, SEGMENT_BYTES):
        width = min(SEGMENT_BYTES, page - at)
        out.append(
            (at, width, (at // block, tail if at + width == page else (at + width) // block))
        )
    return out


def host_copies(copies: PageCopies) -> None:
    """Make ``copies`` with torch, now (layer by layer with a feed, as the CUDA
    copier's 2-D copies): the host as the "device"."""
    feed, page = copies.feed, copies.nbytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only mapping: only read
        if feed is None:
            for dst, src in copies.views():
                dst.copy_(torch.from_numpy(src))
            return
        width, rows, runs = page // feed.layers, copies.rows(), copies.runs()
        for layer in range(feed.layers):
            at = layer * width
            for si, so, do, n in runs:
                into = copies.dst[do : do + n * page].view(n, page)[:, at : at + width]
                host = torch.from_numpy(copies.sources[si][so : so + n * page])
                into.copy_(host.view(n, page)[:, at : at + width])
            feed.queued(layer, rows, None)


def _download(accs: torch.Tensor) -> torch.Tensor:
    """Queue a copy of ``accs`` into pinned host memory on the current stream."""
    host = torch.empty(accs.shape, dtype=torch.int64, pin_memory=True)
    return host.copy_(accs, non_blocking=True)


# Waiting for a landing on the loop: asleep until this long before its expected end,
# then asking its event each turn, for at most POLL_AFTER past that end (then in a
# thread). The loop's sleeps end up to 1 ms late (epoll's timeout is in milliseconds).
# Measured on an H200 host (bench/gpu_check.py section 6, 256 MiB gets): waiting in a
# thread, the loop heard of the end 0.3-0.4 ms after it (2 MiB pages: 6.74 ms a get
# against 6.32 asking every turn; 64 KiB pages 9.77 against 8.65).
POLL_BEFORE = 1.5e-3
POLL_AFTER = 2e-3


class BusPace:
    """How fast a copier's recent landings went on the device, from their first copy to
    their last check, timed by CUDA events: when the next one should end. The fastest
    of the last ``KEPT`` landings of at least ``TIMED_BYTES``: the bus has a top speed
    that contention only lowers, so an estimate from it errs early (the loop asks a
    little longer) rather than late (the loop would sleep past the end); small
    landings, whose time is mostly fixed costs, teach nothing. Timed by the host's
    clock, a late wait had taught a slower pace and the next wait slept later still
    (seen on an H200: 16 MiB gets settling at 1.5 s each). Used on the client's loop."""

    KEPT = 8
    TIMED_BYTES = 8 << 20

    def __init__(self) -> None:
        self._rates: collections.deque[float] = collections.deque(maxlen=self.KEPT)

    @property
    def rate(self) -> float:
        """Bytes a second; 0 before a landing was timed."""
        return max(self._rates, default=0.0)

    def end(self, started: float, nbytes: int) -> float | None:
        """The ``time.perf_counter()`` by which a landing of ``nbytes`` whose first
        copy was queued at ``started`` should be over; None before any was timed."""
        rate = self.rate
        return started + nbytes / rate if rate > 0 else None

    def measured(self, nbytes: int, seconds: float) -> None:
        if nbytes >= self.TIMED_BYTES and seconds > 0:
            self._rates.append(nbytes / seconds)


async def settled(done: Any, until: float | None = None) -> None:
    """Wait for the work before ``done`` (a CUDA event) so the loop serves other nodes'
    transfers meanwhile: in a thread, or, given the time it should pass (``until``,
    ``BusPace.end``), asleep until shortly before then and asking the event every turn
    after (a thread's word reaches the loop late). Cancelled, it still waits, here: no
    copy may land in a caller's memory after its call has returned (the caller may reuse
    it at once)."""
    if done.query():
        return
    try:
        if until is not None:
            ahead = until - time.perf_counter() - POLL_BEFORE
            if ahead > 0:
                await asyncio.sleep(ahead)
            give_up = max(until, time.perf_counter()) + POLL_AFTER
            while not done.query() and time.perf_counter() < give_up:
                await asyncio.sleep(0)
        if not done.query():
            await asyncio.to_thread(done.synchronize)
    except asyncio.CancelledError:
        done.synchronize()  # queued on the device already: bounded by the copy itself
        raise
