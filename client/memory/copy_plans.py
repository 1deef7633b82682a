"""Which copies a get into device memory makes (``client.memory.device_pages``): runs of
pages that lie back to back on both sides, joined (``merged``, ``runs``); a layer-wise
landing's runs and the rows they cover (``layer_runs``); and which pages' checks are
queued together (``check_batches``). Plain lists: a 1,024-page get of 64 KiB pages spends
its Python time per page."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from client.memory.buffers import Span

if TYPE_CHECKING:
    from client.memory.device_pages import DeviceSpan

# Bytes of pages whose checks are queued together behind their copies: the device
# hashes one batch while the next crosses the bus, so a get waits after its last copy
# only for the checks of the last batch.
CHECK_BATCH = 32 << 20
LAST_CHECK_BATCH = 8 << 20


def merged(copies: list[tuple[DeviceSpan, Span]]) -> list[tuple[torch.Tensor, np.ndarray]]:
    """Copies whose sources and destinations both continue the one before, joined: the
    device and host views of each copy to make."""
    return [(db[do : do + n], hb[ho : ho + n]) for db, do, hb, ho, n in runs(copies)]


def runs(copies: list[tuple[DeviceSpan, Span]]) -> list[list[Any]]:
    """``merged``'s runs as ``[device base, device offset, host base, host offset,
    bytes]`` (plain lists: a 1,024-page get of 64 KiB pages spends its Python time per
    page)."""
    joined: list[list[Any]] = []
    for dst, src in copies:
        if joined:
            run = joined[-1]
            if (
                run[0] is dst.base
                and run[1] + run[4] == dst.offset
                and run[2] is src.base
                and run[3] + run[4] == src.offset
                and not src.pieces
            ):
                run[4] += dst.nbytes
                continue
        if src.pieces or src.nbytes != dst.nbytes:
            raise ValueError("a device copy takes a contiguous host span of the page's size")
        joined.append([dst.base, dst.offset, src.base, src.offset, dst.nbytes])
    return joined


def layer_runs(
    copies: list[tuple[DeviceSpan, Span]], layers: int
) -> tuple[int, list[list[Any]], list[int]]:
    """A layer-wise landing's plan: the bytes of one layer of a page, the runs of
    ``runs``, and the rows (page places in the device tensor) they cover."""
    page = copies[0][0].nbytes
    joined = runs(copies)
    rows = [r for run in joined for r in range(run[1] // page, (run[1] + run[4]) // page)]
    return page // layers, joined, rows


def check_batches(sizes: list[int]) -> list[list[int]]:
    """The pages (by position) whose checks are queued together: consecutive pages of
    about ``CHECK_BATCH`` bytes, the last batch at most ``LAST_CHECK_BATCH`` (at least
    one page), since its checks are what a get waits for after its copies."""
    tail, tail_bytes = len(sizes), 0
    while tail > 1 and (not tail_bytes or tail_bytes + sizes[tail - 1] <= LAST_CHECK_BATCH):
        tail -= 1
        tail_bytes += sizes[tail]
    batches: list[list[int]] = [[]]
    size = 0
    for k, nbytes in enumerate(sizes):
        if size >= CHECK_BATCH or (k == tail and batches[-1]):
            batches.append([])
            size = 0
        batches[-1].append(k)
        size += nbytes
    return batches
