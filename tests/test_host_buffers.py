"""The process's pool of host buffers (client.staging.HostBuffers): blocks are reused,
coalesced when given back, and a lent tensor's memory returns only once the caller
has dropped every view of it."""

import gc

import numpy as np
import torch

from client.staging import ALIGN, HostBuffers


def test_blocks_are_taken_from_the_arena_and_coalesce_when_given_back():
    pool = HostBuffers()
    pool.reserve(16 * ALIGN)
    arena = pool.free_bytes
    assert arena == 16 * ALIGN
    a, b, c = pool.take(3 * ALIGN), pool.take(ALIGN + 1), pool.take(4 * ALIGN)
    assert pool.free_bytes == arena - 9 * ALIGN  # sizes round up to whole pages
    assert len({a.ctypes.data, b.ctypes.data, c.ctypes.data}) == 3
    big = pool.take(12 * ALIGN)  # cannot fit in what is left: fresh memory, not the pool's
    assert pool.free_bytes == arena - 9 * ALIGN
    pool.give(big)  # a block the pool never gave is ignored
    for buf in (b, a, c):
        pool.give(buf)
    assert pool.free_bytes == arena
    whole = pool.take(16 * ALIGN)  # the three blocks and the rest merged into one again
    assert whole.ctypes.data == a.ctypes.data and pool.free_bytes == 0


def test_a_lent_tensor_returns_to_the_pool_only_after_its_last_view():
    pool = HostBuffers()
    pool.reserve(8 * ALIGN)
    t = pool.lend(4 * ALIGN, torch.float16, (2, ALIGN))
    t.fill_(1.5)
    key = t[0]  # a view, as select returns key and value of one block
    as_numpy = t[1].numpy()
    del t
    gc.collect()
    assert pool.free_bytes == 4 * ALIGN  # views still alive: the memory stays taken
    del key
    gc.collect()
    assert pool.free_bytes == 4 * ALIGN
    assert np.all(as_numpy == np.float16(1.5))
    del as_numpy
    gc.collect()
    assert pool.free_bytes == 8 * ALIGN
