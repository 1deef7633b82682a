"""The vLLM connector's host page buffers (``StagingPool``), which its worker's loads and
saves stage pages through."""

from __future__ import annotations

from typing import Protocol

import torch

from client.memory.staging import ALIGN, HostBuffers, host_buffers


class PageFormat(Protocol):
    """What the pool needs of the cache it stages for (``client.paging.paged_cache.PagedCache``):
    a page's shape, dtype and size, and fresh host pages past the pool's bound."""

    page_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def page_nbytes(self) -> int: ...

    def host_pages(self, count: int) -> torch.Tensor: ...


class StagingPool:
    """The connector's host page buffers: pages of the process's one host-buffer pool
    (``client.memory.staging.HostBuffers``), the pool the worker's client stages and receives
    through too, so both share what is faulted in and what the pool grew.

    A fresh 120 MiB host tensor costs its page faults on first write: measured here, a
    96-page get into a reused buffer took 36 ms against 77-130 ms into a new one. So
    the connector reserves room for ``buffers`` transfers of ``pages`` pages each (one
    per loader thread and one save), faulted in now; ``take`` hands out pages of the
    pool, which grows past that to its bound and keeps what it grew, and only past the
    bound allocates (pinned when the cache is on a GPU; never waits); ``give`` returns
    them. Thread-safe: loader threads, the engine thread (gather) and the saver thread
    share it. ``pool``: the process's pool unless a test passes its own; ``share``: the
    pool's name for this reservation (a draft's pool adds its own to the target's)."""

    def __init__(
        self,
        cache: PageFormat,
        buffers: int,
        pages: int,
        pool: HostBuffers | None = None,
        share: str = "staging",
    ) -> None:
        self.cache = cache
        self.pages = pages
        self._pool = host_buffers() if pool is None else pool
        self._page_nbytes = cache.page_nbytes
        # the pool hands out whole 4 KiB pages
        per_buffer = -(-max(pages, 0) * self._page_nbytes // ALIGN) * ALIGN
        self._pool.reserve(max(buffers, 0) * per_buffer, share=share)

    def take_pages(self, count: int) -> torch.Tensor:
        """``count`` pages of host memory; rows are uninitialised."""
        block = self._pool.try_take_buffer(count * self._page_nbytes)
        if block is None:
            return self.cache.host_pages(count)
        return torch.from_numpy(block).view(self.cache.dtype).view((count, *self.cache.page_shape))

    def give_pages(self, pages: torch.Tensor) -> None:
        """Return what ``take`` gave (a fresh allocation is simply dropped)."""
        self._pool.give_buffer(pages)
