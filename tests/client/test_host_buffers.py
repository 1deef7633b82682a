"""The process's pool of host buffers (client.memory.staging.HostBuffers): blocks are reused,
coalesced when given back, and a lent tensor's memory returns only once the caller
has dropped every view of it; past what was reserved the pool grows to its bound and
keeps what it grew, and past the bound a request gets fresh memory."""

import gc
import threading

import numpy as np
import torch

from client.memory.staging import ALIGN, HostBuffers


def in_pool(pool: HostBuffers, buf: np.ndarray | torch.Tensor) -> bool:
    """Whether ``buf`` lies in one of the pool's arenas (else it is fresh memory)."""
    addr = buf.data_ptr() if isinstance(buf, torch.Tensor) else buf.ctypes.data
    return any(a.ctypes.data <= addr < a.ctypes.data + a.nbytes for a in pool._arenas)


def test_blocks_are_taken_from_the_arena_and_coalesce_when_given_back():
    pool = HostBuffers(growth=1)  # no growth: what does not fit is fresh memory
    pool.reserve(16 * ALIGN)
    arena = pool.free_bytes
    assert arena == 16 * ALIGN
    a, b, c = pool.take_buffer(3 * ALIGN), pool.take_buffer(ALIGN + 1), pool.take_buffer(4 * ALIGN)
    assert pool.free_bytes == arena - 9 * ALIGN  # sizes round up to whole pages
    assert len({a.ctypes.data, b.ctypes.data, c.ctypes.data}) == 3
    big = pool.take_buffer(12 * ALIGN)  # cannot fit in what is left: fresh memory, not the pool's
    assert pool.free_bytes == arena - 9 * ALIGN and not in_pool(pool, big) and pool.fresh_takes == 1
    pool.give_buffer(big)  # a block the pool never gave is ignored
    for buf in (b, a, c):
        pool.give_buffer(buf)
    assert pool.free_bytes == arena
    whole = pool.take_buffer(16 * ALIGN)  # the three blocks and the rest merged into one again
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


def test_the_pool_grows_to_its_bound_keeps_what_it_grew_and_past_it_gives_fresh_memory():
    pool = HostBuffers(growth=2, grow_step=2 * ALIGN)
    pool.reserve(10 * ALIGN)
    assert pool.limit == 20 * ALIGN and pool.held == 10 * ALIGN
    first = pool.take_buffer(6 * ALIGN)
    second = pool.take_buffer(6 * ALIGN)  # 4 pages left in the reserve: the pool grows by 6
    assert in_pool(pool, second) and pool.held == 16 * ALIGN and pool.fresh_takes == 0
    pool.give_buffer(second)
    again = pool.take_buffer(6 * ALIGN)  # what the pool grew stayed: the same memory, no new arena
    assert again.ctypes.data == second.ctypes.data and pool.held == 16 * ALIGN
    past = pool.take_buffer(
        5 * ALIGN
    )  # 4 pages of room before the bound, and free blocks of 4: fresh
    assert not in_pool(pool, past) and pool.fresh_takes == 1 and pool.held == 16 * ALIGN
    assert (
        pool.try_take_buffer(5 * ALIGN) is None and pool.fresh_takes == 2
    )  # for a caller whose fresh memory is its own
    for buf in (first, again):
        pool.give_buffer(buf)
    assert pool.free_bytes == 16 * ALIGN


def test_a_caller_holding_the_last_result_while_it_asks_for_the_next_gets_pooled_memory():
    """``kv = client.select(...)`` in a loop: the next result is lent while the last is
    still held. The pool grows once for the second and then reuses both, never fresh."""
    pool = HostBuffers()
    result = 6 * ALIGN
    pool.reserve(10 * ALIGN)  # room for one result, not two
    kv = None
    addresses = set()
    for i in range(6):
        kv = pool.lend(
            result, torch.float16, (2, result // 4)
        )  # the last one is dropped only once this returns
        kv.fill_(i)
        addresses.add(kv.data_ptr())
        assert in_pool(pool, kv)
        gc.collect()
    assert pool.fresh_takes == 0 and len(addresses) == 2 and pool.held <= pool.limit
    assert torch.all(kv == 5)  # the held result was never handed out again while held


def test_a_share_keeps_its_largest_reservation_and_shares_add_up():
    pool = HostBuffers()
    pool.reserve(8 * ALIGN)
    pool.reserve(4 * ALIGN)  # another client of the process: the largest wins
    assert pool.reserved == 8 * ALIGN and pool.held == 8 * ALIGN
    pool.reserve(6 * ALIGN, share="staging")  # the connector's page buffers, on top
    pool.reserve(6 * ALIGN, share="staging")  # a connector worker made again: not twice
    assert pool.reserved == 14 * ALIGN and pool.held == 14 * ALIGN and pool.free_bytes == 14 * ALIGN


def test_threads_growing_at_once_stay_under_the_bound():
    pool = HostBuffers(growth=2, grow_step=ALIGN)
    pool.reserve(16 * ALIGN)
    taken: list[np.ndarray] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def grab() -> None:
        start.wait()
        for _ in range(8):
            buf = pool.take_buffer(ALIGN)
            with lock:
                taken.append(buf)

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pooled = [b for b in taken if in_pool(pool, b)]
    assert pool.held == pool.limit == 32 * ALIGN and len(pooled) == 32 and pool.fresh_takes == 32
    assert len({b.ctypes.data for b in pooled}) == 32  # no block handed out twice
