"""One kernel launch that copies a request's blocks of every layer out of a paged KV
cache into page-major rows on the device (``LayerGather``): the GPU save's copy on
the engine thread; and the other way, rows into blocks (``LayerGather.scatter``): a
load's last step, on the loader thread.

Who calls it: ``PagedCache.gather`` on a GPU, at the end of an engine step, before the
blocks can be reused; ``PagedCache.scatter`` with whole pages. One indexed copy per
layer costs the engine thread a kernel launch each: measured on an H200, 32 layers'
``index_select`` calls held it 0.90 ms for a 512 MiB save and the first decode step
after the save took 1.45x a step without one; this one Triton launch, which reads every
layer through its own strides (any ``KVCacheLayout``) and writes each page in its byte
order (no reorder follows), 0.54 ms and 1.20x. Used where Triton runs and the layers
share one dtype and one set of strides (vLLM gives every layer the same view); else
``PagedCache`` keeps its indexed copies."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# elements of one page's layer part a program copies
ROW = 1024
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class GatherResult:
    """Host pages ``[n, *page_shape]``; ``ready`` (a CUDA event, or None on CPU) must be
    synchronized before the bytes are read."""

    pages: torch.Tensor
    ready: Any = None

    def wait(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.pages


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    from client.paging import _gather_kernel

    return _gather_kernel.gather


def why_not(layers: list[torch.Tensor]) -> str | None:
    """None when ``LayerGather`` serves these layers, else why not."""
    from kvstore.pages import device_checksum

    if (why := device_checksum.available()) is not None:
        return why
    first = layers[0]
    if first.element_size() not in _INT_OF_SIZE:
        return f"elements of {first.element_size()} bytes"
    if any(kv.stride() != first.stride() or kv.dtype != first.dtype for kv in layers):
        return "the layers' strides or dtypes differ"
    return None


def one_launch(layers: list[torch.Tensor]) -> LayerGather | None:
    """``LayerGather`` for ``layers``, or None where it cannot serve them (logged)."""
    why = why_not(layers)
    if why is None:
        return LayerGather(layers)
    log.info("saves and loads copy one layer at a time: %s", why)
    return None


class LayerGather:
    """Copies blocks of every layer of ``layers`` (each ``[blocks, heads, block_size, C]``
    of one dtype and one set of strides, on one device) into page-major rows
    ``[n, layers, heads, block_size, C]``. Built once per paged cache (the layers never
    move); called on the engine thread."""

    def __init__(self, layers: list[torch.Tensor]) -> None:
        first = layers[0]
        self._item = first.element_size()
        self._anchor = first.view(_INT_OF_SIZE[self._item])
        base = first.data_ptr()
        at = [(kv.data_ptr() - base) // self._item for kv in layers]
        self._layer_at = torch.tensor(at, dtype=torch.int64).to(first.device)
        self._layers = len(layers)
        _, self._heads, self._block, self._c = first.shape
        self._strides = first.stride()
        self._device = first.device
        self._dtype = first.dtype

    def __call__(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Queue, on the current stream, the copy of blocks ``block_ids`` into ``out``
        (contiguous, ``[len(block_ids), layers, heads, block_size, C]``, on the cache's
        device and of its element size)."""
        self._launch(block_ids, out, to_cache=False)

    def scatter(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """The other way, for a load: queue the copy of ``pages`` (as ``out`` above)
        into blocks ``block_ids`` of every layer, in one launch. On an H200 a 256 MiB
        load through the connector, scattered by an indexed copy per layer, took
        1.2 ms more than its get alone (bench/gpu_check.py sections 1 and 6)."""
        self._launch(block_ids, pages, to_cache=True)

    def takes(self, pages: torch.Tensor) -> bool:
        """Whether ``pages`` are whole pages as ``scatter`` takes them: contiguous, every
        layer and head, of the cache's device and dtype."""
        shape = (self._layers, self._heads, self._block, self._c)
        return (
            tuple(pages.shape[1:]) == shape
            and pages.is_contiguous()
            and pages.device == self._device
            and pages.dtype == self._dtype
        )

    def _launch(self, block_ids: list[int], out: torch.Tensor, to_cache: bool) -> None:
        n = len(block_ids)
        if not n:
            return
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        if self._device.type == "cuda":  # pinned: a pageable upload would wait for the step
            blocks = blocks.pin_memory()
        blocks = blocks.to(self._device, non_blocking=True)
        inner = self._heads * self._block * self._c
        s_blk, s_h, s_b, s_c = self._strides
        out_at = (out.data_ptr() - self._anchor.data_ptr()) // self._item
        _kernel()[(n * self._layers, -(-inner // ROW))](
            self._anchor,
            self._layer_at,
            blocks,
            out_at,
            self._layers,
            inner,
            self._block * self._c,
            s_blk,
            s_h,
            s_b,
            s_c,
            C=self._c,
            ROW=ROW,
            TO_CACHE=to_cache,
        )
