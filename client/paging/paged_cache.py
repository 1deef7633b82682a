"""Copies between store pages and an engine's paged KV cache: ``PagedCache``.

A page is one block of every layer, ``[layers, kv_heads, block_size, 2 * head_size]``,
contiguous. The engine keeps one tensor per layer whose logical view is
``[blocks, kv_heads, block_size, 2 * head_size]`` (vLLM 0.32's connector view); its
physical strides follow the backend's ``KVCacheLayout`` and may put blocks anywhere in
memory order. ``PagedCache`` only uses strided copies, so any stride permutation works
and the bytes are exact.

Block ids of one request mostly form contiguous runs (the allocator hands out free
blocks in order), so each layer is copied run by run: one strided copy per run and
layer instead of an index gather. Measured on the 2-core CI machine, 96 pages of 10
layers x 128 KiB (126 MiB): scatter 14.8 ms in runs vs 17.5 ms with ``index_copy_``,
gather 42 ms vs 62 ms with ``index_select``. Fragmented lists (more runs than
``_MAX_RUNS``) fall back to one indexed copy per layer.

On a GPU every copy is a kernel the calling thread launches, so whole pages move in one
launch for every layer (``client.paging.gather_pages``), else by an indexed copy per
layer. ``scatter`` takes pages already in device memory (the connector's loads land
there: ``client.memory.device_pages``) or copies host pages over in one copy first;
``gather`` copies the blocks into a device scratch on the current stream (before any
later work can reuse them) and the scratch to the host on a stream of its own, on the
copy engines, beside the next steps (``GatherResult.ready`` is the event to wait on), so
the engine thread only queues the copies.

Called by the vLLM connector's worker side: ``gather`` on the engine thread (the blocks
may be reused once the step ends), ``scatter`` on the loader thread (the blocks belong
to a request that waits for them and nothing else touches). The host page buffers both
stage through are ``client.paging.staging_pool.StagingPool``."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Literal

import numpy as np
import torch

from client.memory.buffers import Span, block_runs
from client.memory.device_rows import DeviceRows
from client.paging.cache_spans import BlockMajor, CacheSpans
from client.paging.gather_pages import GatherResult, LayerGather, one_launch
from kvstore.errors import InvalidInputError
from kvstore.pages.layouts import LAYOUTS

_MAX_RUNS = 64


class PagedCache:
    """The per-layer KV tensors of one worker, in layer order, holding pages of
    ``layout`` (a record of ``kvstore.pages.layouts``; its per-layer cache tensors must
    put the blocks first)."""

    def __init__(self, layers: list[torch.Tensor], layout: str = "vllm_cpu") -> None:
        if not layers:
            raise InvalidInputError("PagedCache needs at least one layer tensor")
        record = LAYOUTS[layout]
        if not record.cache_dims or record.block_axis != 0:
            raise InvalidInputError(
                f"PagedCache pages caches whose blocks are their first dimension; layout "
                f"{layout} has {record.cache_dims or 'no engine cache'}"
            )
        rank = len(record.cache_dims)
        first = layers[0]
        for i, t in enumerate(layers):
            if (
                t.dim() != rank
                or t.shape != first.shape
                or t.dtype != first.dtype
                or t.device != first.device
            ):
                raise InvalidInputError(
                    f"layer {i}: every layer must be a {rank}-D view ({layout}: "
                    f"{', '.join(record.cache_dims)}) of one shape, dtype and device "
                    f"(layer 0 is {tuple(first.shape)} {first.dtype} on {first.device}, layer {i} is "
                    f"{tuple(t.shape)} {t.dtype} on {t.device})"
                )
        self.layers = layers
        self.num_blocks = first.shape[0]
        self.page_shape = (len(layers), *first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        self._on_gpu = first.device.type == "cuda"
        # the cache's blocks as byte spans (``block_spans``), False where they cannot be
        self._spans: CacheSpans | Literal[False] | None = None
        self._block_major = BlockMajor.of(layers)  # None: no page is one range (``device_rows``)
        self._save_stream: Any = None  # GPU: device-to-host copies of saves (``gather``)
        # GPU: the one-launch copy of a save's blocks (client.paging.gather_pages), None
        # where it cannot serve these layers; asked once (``_layer_gather``)
        self._gatherer: LayerGather | None = None
        self._gatherer_asked = False

    def outside(self, block_ids: Sequence[int], null_ok: bool = False) -> list[int]:
        """The ids of ``block_ids`` naming no block of this cache (the null block 0 too
        unless ``null_ok``): every copy into it asks (a device-side assert on CUDA)."""
        low = 0 if null_ok else 1
        return [b for b in block_ids if not low <= b < self.num_blocks]

    def _check(
        self,
        block_ids: list[int],
        pages: torch.Tensor | None = None,
        head_at: int = 0,
        layer_at: int = 0,
    ) -> None:
        if bad := self.outside(block_ids, null_ok=True):
            raise InvalidInputError(
                f"block ids {bad[:4]} outside the cache's {self.num_blocks} blocks"
            )
        shape = self.page_shape
        if (
            pages is not None
            and pages.dim() == len(self.page_shape) + 1
            and (layer_at or pages.shape[1] != self.page_shape[0])
        ):
            layers = pages.shape[1]  # a range of layers (heads.rank_parts of layer groups)
            if layer_at < 0 or layers < 1 or layer_at + layers > self.page_shape[0]:
                raise InvalidInputError(
                    f"layers {layer_at} to {layer_at + layers - 1} lie outside the cache's {self.page_shape[0]}"
                )
            shape = (layers, *shape[1:])
        if (
            pages is not None
            and pages.dim() == len(self.page_shape) + 1
            and (head_at or pages.shape[2] != self.page_shape[1])
        ):
            heads = pages.shape[2]  # a range of heads (heads.rank_parts)
            if head_at < 0 or heads < 1 or head_at + heads > self.page_shape[1]:
                raise InvalidInputError(
                    f"heads {head_at} to {head_at + heads - 1} lie outside the cache's {self.page_shape[1]}"
                )
            shape = (shape[0], heads, *self.page_shape[2:])
        if pages is not None and (
            pages.shape[0] < len(block_ids)
            or tuple(pages.shape[1:]) != shape
            or pages.dtype != self.dtype
        ):
            raise InvalidInputError(
                f"pages must be [{len(block_ids)}, {', '.join(map(str, self.page_shape))}] of {self.dtype}, "
                f"got {tuple(pages.shape)} {pages.dtype}"
            )

    def block_spans(self, block_ids: list[int]) -> list[Span] | None:
        """Each block's page as a span over the cache itself (``CacheSpans.of``), or None
        for a cache in device memory or whose bytes cannot be viewed."""
        self._check(block_ids)
        if self._spans is None:
            self._spans = (
                None if self._on_gpu else CacheSpans.over(self.layers, self._block_major)
            ) or False
        return self._spans.of(block_ids) if self._spans else None

    def device_rows(self, block_ids: list[int]) -> DeviceRows | None:
        """Each block's page as a row of the cache itself, for a get that lands pages
        straight in their blocks (``KVCacheClient.get_found_device``); None unless the
        cache is block-major (``BlockMajor``), where a page is one contiguous range."""
        self._check(block_ids)
        major = self._block_major
        return None if major is None else major.rows(block_ids, self.page_nbytes)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page (every layer's block)."""
        return int(np.prod(self.page_shape)) * self.layers[0].element_size()

    def host_pages(self, count: int) -> torch.Tensor:
        """An empty host tensor for ``count`` pages, pinned when the cache is on a GPU."""
        return torch.empty((count, *self.page_shape), dtype=self.dtype, pin_memory=self._on_gpu)

    def _copy(
        self,
        block_ids: list[int],
        pages: torch.Tensor,
        to_cache: bool,
        head_at: int = 0,
        layer_at: int = 0,
    ) -> None:
        """Per layer, copy ``pages[i]`` <-> block ``block_ids[i]`` on ``pages``' device,
        which is the cache's; ``pages`` may hold a range of heads starting at ``head_at``
        and of layers starting at ``layer_at``."""
        runs = block_runs(block_ids)
        # On a GPU every copy is a kernel launch the calling thread pays for (the engine
        # thread, in a save): one indexed copy per layer, whatever the runs. Measured on
        # an H200, a 512 MiB save as 16 runs x 32 layers of strided copies held the
        # engine thread 7-10 ms (gpu_check section 4).
        index = (
            None
            if len(runs) <= _MAX_RUNS and not self._on_gpu
            else torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
        )
        n = len(block_ids)
        heads = pages.shape[2]
        for layer, kv in enumerate(self.layers[layer_at : layer_at + pages.shape[1]]):
            if heads != kv.shape[1]:
                kv = kv.narrow(1, head_at, heads)
            src_dst = pages[:n, layer]
            if index is not None:
                if to_cache:
                    kv.index_copy_(0, index, src_dst)
                else:
                    src_dst.copy_(kv.index_select(0, index))
                continue
            for page, block, length in runs:
                cache_part = kv.narrow(0, block, length)
                page_part = src_dst.narrow(0, page, length)
                (cache_part if to_cache else page_part).copy_(page_part if to_cache else cache_part)

    def _copy_layers(
        self,
        pages: torch.Tensor,
        layer_rows: list[tuple[list[int], list[int]]],
        to_cache: bool,
        head_at: int = 0,
        layer_at: int = 0,
    ) -> int:
        """Hybrid groups: per layer ``layer_at + j`` of ``pages``, copy ``pages[rows[k], j]``
        <-> block ``blocks[k]`` of that layer (``layer_rows[layer] = (rows, blocks)``: each
        layer has its own group's block ids, and may skip positions). One indexed copy per
        layer: the groups' layers alias one memory (a block id belongs to one group at a
        time), so no layer's copy may stand for another's. Returns the bytes copied."""
        copied = 0
        heads = pages.shape[2]
        for j in range(pages.shape[1]):
            rows, blocks = layer_rows[layer_at + j]
            if not rows:
                continue
            if bad := self.outside(blocks):
                raise InvalidInputError(
                    f"block ids {bad[:4]} outside the cache's blocks 1 to {self.num_blocks - 1}"
                )
            kv = self.layers[layer_at + j]
            if heads != kv.shape[1]:
                kv = kv.narrow(1, head_at, heads)
            row_index = torch.tensor(rows, dtype=torch.long, device=pages.device)
            block_index = torch.tensor(blocks, dtype=torch.long, device=self.device)
            if to_cache:
                kv.index_copy_(
                    0, block_index, pages[:, j].index_select(0, row_index).to(self.device)
                )
            else:
                pages[:, j].index_copy_(
                    0, row_index, kv.index_select(0, block_index).to(pages.device)
                )
            copied += len(rows) * kv[0].numel() * kv.element_size()
        return copied

    def gather_layers(
        self, layer_rows: list[tuple[list[int], list[int]]], out: torch.Tensor
    ) -> GatherResult:
        """Hybrid groups: fill rows of the host pages ``out`` from each layer's own blocks
        (``_copy_layers``), a layer's part of a row it skips with zeros. Called on the
        engine thread at the end of the step, before vLLM can free the blocks; on a GPU
        the device-to-host copy is left in flight (``GatherResult.ready``)."""
        gathered = {r for rows, _ in layer_rows for r in rows}
        if not self._on_gpu:
            self._copy_layers(out, layer_rows, to_cache=False)
            # a layer's part of a row it skips is zeros, as from the GPU's scratch: never
            # the stale bytes of a pooled buffer (another request's, maybe another tenant's)
            for j, (layer, _) in enumerate(layer_rows):
                if skipped := sorted(gathered.difference(layer)):
                    out[skipped, j] = 0
            return GatherResult(out)
        scratch = torch.zeros(
            (out.shape[0], *self.page_shape), dtype=self.dtype, device=self.device
        )
        self._copy_layers(scratch, layer_rows, to_cache=False)
        rows = sorted(gathered)
        # only the rows gathered now: earlier steps filled the others
        runs = [slice(rows[first], rows[first] + length) for first, _, length in block_runs(rows)]
        return self._copy_out(out, scratch, [(out[r], scratch[r]) for r in runs])

    def scatter_layers(
        self,
        pages: torch.Tensor,
        layer_rows: list[tuple[list[int], list[int]]],
        stream: Any = None,
        head_at: int = 0,
        layer_at: int = 0,
    ) -> int:
        """Hybrid groups: ``scatter`` with each layer's own rows and blocks
        (``_copy_layers``); returns the bytes written into the cache once they are in
        place. Called on a loader thread."""
        if not self._on_gpu:
            return self._copy_layers(
                pages, layer_rows, to_cache=True, head_at=head_at, layer_at=layer_at
            )
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            device_pages = pages.to(self.device, non_blocking=True)
            copied = self._copy_layers(
                device_pages, layer_rows, to_cache=True, head_at=head_at, layer_at=layer_at
            )
            (stream or torch.cuda.current_stream()).synchronize()
        return copied

    def gather(self, block_ids: list[int], out: torch.Tensor | None = None) -> GatherResult:
        """Copy blocks ``block_ids`` out of the cache into host pages (``out``, or new
        ones). On a GPU the blocks are copied into device pages on the current stream,
        after the work that wrote them and before any later work can reuse them (a
        block vLLM frees, a preempted request's, is rewritten only by later work on
        that stream); the device-to-host copy then runs on a stream of its own, on the
        copy engines, beside the next steps (``GatherResult.ready`` marks its end). So
        the calling thread (the engine's) only queues one copy kernel (or one indexed
        copy per layer where Triton is missing)."""
        self._check(block_ids, out)
        host = self.host_pages(len(block_ids)) if out is None else out[: len(block_ids)]
        if not self._on_gpu:
            self._copy(block_ids, host, to_cache=False)
            return GatherResult(host)
        gather = self._layer_gather()
        if gather is not None:  # one launch for every layer
            pages = torch.empty(
                (len(block_ids), *self.page_shape), dtype=self.dtype, device=self.device
            )
            gather(block_ids, pages)
            return self._copy_out(host, pages, [(host, pages)])
        # One indexed copy per layer into a layer-major scratch, each a contiguous
        # output; the reorder into pages happens on the save stream, in the copy to the
        # host (measured on an H200 before this, a 512 MiB save as copies per run and
        # layer held the engine thread 11 ms, and as index_select plus a copy into the
        # page-major scratch per layer 1.4 ms; as this, 0.90 ms).
        index = torch.tensor(block_ids, dtype=torch.long).pin_memory()
        index = index.to(self.device, non_blocking=True)
        by_layer = torch.empty(
            (len(self.layers), len(block_ids), *self.page_shape[1:]),
            dtype=self.dtype,
            device=self.device,
        )
        for layer, kv in enumerate(self.layers):
            torch.index_select(kv, 0, index, out=by_layer[layer])
        return self._copy_out(host, by_layer, [(host, by_layer.transpose(0, 1))])

    def _layer_gather(self) -> LayerGather | None:
        """GPU: the one-launch copies of blocks, asked for once (None: one per layer)."""
        if not self._gatherer_asked:
            self._gatherer_asked, self._gatherer = True, one_launch(self.layers)
        return self._gatherer

    def warm(self) -> None:
        """GPU: compile the copy kernels of saves and loads now, at registration
        (seconds, once per process), rather than in the first save's engine step."""
        if self._on_gpu and self.num_blocks:
            gather = self._layer_gather()
            if gather is not None:  # both ways: block 0's bytes out and back, unchanged
                page = torch.empty((1, *self.page_shape), dtype=self.dtype, device=self.device)
                gather([0], page)
                gather.scatter([0], page)
                torch.cuda.current_stream(self.device).synchronize()

    def _copy_out(
        self, host: torch.Tensor, scratch: torch.Tensor, copies: list[tuple[torch.Tensor, Any]]
    ) -> GatherResult:
        """Queue each ``(host part, device part)`` copy on the save stream, after the
        current stream's work so far; ``scratch`` stays allocated until they have read
        it. The result's pages are ``host``."""
        if self._save_stream is None:
            self._save_stream = torch.cuda.Stream(device=self.device)
        written = torch.cuda.Event()
        written.record()
        with torch.cuda.stream(self._save_stream):
            self._save_stream.wait_event(written)
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            scratch.record_stream(self._save_stream)
            ready = torch.cuda.Event()
            ready.record(self._save_stream)
        return GatherResult(host, ready)

    def scatter(
        self,
        pages: torch.Tensor,
        block_ids: list[int],
        stream: Any = None,
        head_at: int = 0,
        layer_at: int = 0,
    ) -> None:
        """Write ``pages[i]`` (host or device) into block ``block_ids[i]`` of every layer,
        and return once the bytes are in place. ``pages`` may be a strided view holding
        a range of heads and layers (``heads.rank_parts``), written from head ``head_at``
        and layer ``layer_at`` on. On a GPU the copies run on ``stream`` (a side stream
        the caller owns), and this thread waits for it."""
        self._check(block_ids, pages, head_at, layer_at)
        if not self._on_gpu:
            self._copy(block_ids, pages, to_cache=True, head_at=head_at, layer_at=layer_at)
            return
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            device_pages = pages[: len(block_ids)].to(self.device, non_blocking=True)
            copier = self._layer_gather()
            if copier is not None and copier.takes(device_pages):
                copier.scatter(block_ids, device_pages)
            else:
                self._copy(block_ids, device_pages, True, head_at=head_at, layer_at=layer_at)
            (stream or torch.cuda.current_stream()).synchronize()
