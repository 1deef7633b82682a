"""The device landing's bookkeeping (client/memory/device_pages.py, device_landing.py,
copy_plans.py), without nodes: copies of touching pages merged, checks queued in
batches, a failed registration counted and logged once, and how a landing is waited
for (asleep, then asked every turn near its expected end, at the copier's fastest
recent pace). Run with the other device tests by bench/gpu_check.py."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from client.memory.buffers import Span
from client.memory.device_landing import POLL_AFTER, POLL_BEFORE, BusPace, settled
from client.memory.device_pages import CudaCopier
from client.memory.device_rows import DeviceSpan
from client.stats import ClientStats


def test_copies_of_pages_that_touch_are_merged():
    """Pages that lie back to back in a slab and in their rows travel as one copy (one
    DMA on a GPU: measured, 128 separate 2 MiB copies reached 0.93x of one); a page in
    another slab, or not next to the one before on either side, starts a new copy."""
    from client.memory.copy_plans import PageCopies

    slab, other = np.arange(64, dtype=np.uint8), np.arange(64, 128, dtype=np.uint8)
    rows = torch.zeros(64, dtype=torch.uint8)
    copies = PageCopies.of(
        [
            (DeviceSpan(rows, 0, 8), Span(slab, 16, 8)),
            (DeviceSpan(rows, 8, 8), Span(slab, 24, 8)),
            (DeviceSpan(rows, 16, 8), Span(slab, 40, 8)),
            (DeviceSpan(rows, 32, 8), Span(slab, 48, 8)),
            (DeviceSpan(rows, 40, 8), Span(other, 56, 8)),
        ]
    )
    merged = copies.views()
    assert [(d.numel(), int(s[0])) for d, s in merged] == [(16, 16), (8, 40), (8, 48), (8, 120)]
    assert copies.rows() == [0, 1, 2, 4, 5] and copies.source(4).base is other
    with pytest.raises(ValueError, match="one page size"):
        PageCopies.of([(DeviceSpan(rows, 0, 8), Span(slab, 0, 16))])
    with pytest.raises(ValueError, match="one tensor"):
        PageCopies.of(
            [
                (DeviceSpan(rows, 0, 8), Span(slab, 0, 8)),
                (DeviceSpan(rows.clone(), 0, 8), Span(slab, 8, 8)),
            ]
        )


def test_checks_are_queued_in_batches_with_a_small_last_one():
    """A get's checks follow its copies in batches of about 32 MiB; the last batch, what
    the get waits for once its copies are done, is at most 8 MiB or one page."""
    from client.memory.buffers import block_runs
    from client.memory.copy_plans import check_batches

    MiB = 1 << 20

    def sizes(count: int, nbytes: int) -> list[int]:
        batches = check_batches(count, nbytes)
        assert batches[0][0] == 0 and batches[-1][1] == count  # every page, in order, once
        assert all(a[1] == b[0] for a, b in zip(batches, batches[1:]))
        return [end - start for start, end in batches]

    assert sizes(64, 2 * MiB) == [16, 16, 16, 12, 4]
    assert sizes(5, 16 * MiB) == [2, 2, 1]
    assert sizes(1024, 64 << 10) == [512, 384, 128]
    assert sizes(40, 3 * MiB) == [11, 11, 11, 5, 2]
    assert sizes(2, 2 * MiB) == [1, 1]
    assert check_batches(1, MiB) == [(0, 1)] and check_batches(0, MiB) == [(0, 0)]
    assert block_runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (3, 5, 2), (5, 9, 1)]


class _RefusingRuntime:
    """Stands in for CUDA's runtime where no GPU is, only to answer cudaHostRegister
    as a driver does: read-only registration refused (an older driver), and every
    registration of ``refuse`` (a memlock limit). Records the calls."""

    def __init__(self, refuse: set[int]) -> None:
        self.refuse, self.calls, self.cleared = refuse, [], 0

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append((ptr, flags))
        return 1 if flags or ptr in self.refuse else 0

    def cudaGetLastError(self):
        self.cleared += 1


def test_a_failed_registration_is_counted_every_time_and_logged_once(caplog):
    """A node slab the GPU cannot register is never a silent slow copy: each failure
    counts in host_register_failures (the connector exports it), the first is logged,
    CUDA's last error is reset (else torch's next launch would raise it), and a driver
    without read-only registration is asked again with plain flags."""
    stats = ClientStats()
    copier = CudaCopier(torch.device("cuda", 0), stats)
    slabs = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    runtime = _RefusingRuntime({slabs[1].ctypes.data, slabs[2].ctypes.data})
    copier._cudart = runtime
    with caplog.at_level("WARNING", logger="client.memory.device_pages"):
        assert copier.register(slabs[0], writable=False) == slabs[0].ctypes.data
        assert copier.register(slabs[1], writable=False) is None
        assert copier.register(slabs[2], writable=True) is None
    assert runtime.calls[:2] == [(slabs[0].ctypes.data, 8), (slabs[0].ctypes.data, 0)]
    assert (stats.host_registrations, stats.host_register_failures, runtime.cleared) == (1, 2, 2)
    assert sum("cudaHostRegister" in r.getMessage() for r in caplog.records) == 1


class _PassingAt:
    """Stands in for a CUDA event (``query``, ``synchronize``) that passes at ``at``
    (``time.perf_counter``), noting when it was asked and whether a thread waited on it."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.asked: list[float] = []
        self.waited = False

    def query(self) -> bool:
        self.asked.append(time.perf_counter())
        return self.asked[-1] >= self.at

    def synchronize(self) -> None:
        self.waited = True
        time.sleep(max(0.0, self.at - time.perf_counter()))


def _settle(after: float, until: float | None) -> tuple[_PassingAt, float]:
    async def run() -> tuple[_PassingAt, float]:
        event = _PassingAt(time.perf_counter() + after)
        start = time.perf_counter()
        await settled(event, None if until is None else start + until)
        return event, time.perf_counter()

    return asyncio.run(run())


def test_a_landing_is_waited_for_asleep_then_asked_every_turn_near_its_expected_end():
    """Given when a landing should end, the loop sleeps until shortly before it (asking
    nothing meanwhile), then asks its event every turn and returns within a few turns of
    its end, with no thread; asked for far too early, it asks for ``POLL_AFTER`` past
    the estimate, then waits in a thread; with no estimate, in a thread at once. Either
    way it never returns before the event passed."""
    event, returned = _settle(0.03, 0.03)
    assert not event.waited and event.at <= returned < event.at + 0.02
    second = event.asked[1]  # the first is the check on entry
    assert second >= event.at - POLL_BEFORE - 0.002  # asleep until shortly before
    event, returned = _settle(0.05, 0.0)
    assert event.waited and returned >= event.at
    assert event.asked[-1] - event.asked[0] < POLL_AFTER + 0.01  # gave up asking in time
    event, returned = _settle(0.02, None)
    assert event.waited and returned >= event.at and len(event.asked) <= 2


def test_a_copiers_pace_is_its_fastest_recent_landing():
    """``BusPace`` has no estimate before a landing was timed, then the fastest of the
    last ``KEPT`` landings of at least ``TIMED_BYTES`` (a slow one lowers nothing, a
    small one teaches nothing, and old ones are forgotten)."""
    pace, mib = BusPace(), 1 << 20
    assert pace.end(1.0, 100) is None
    pace.measured(8 * mib, 0.5)
    assert pace.end(1.0, 8 * mib) == pytest.approx(1.5)
    pace.measured(8 * mib, 2.0)  # a slow one (contention)
    pace.measured(mib, 1e-6)  # a small one: its rate is its fixed costs'
    assert pace.rate == pytest.approx(16 * mib)
    for _ in range(BusPace.KEPT):
        pace.measured(8 * mib, 1.0)
    assert pace.rate == pytest.approx(8 * mib)
