"""The worker's load path: fetch one request's stored pages, verify them and scatter them
into the paged KV cache (``PageLoader``), on the worker's loader threads.

Called by ``client.vllm.worker.ConnectorWorker``: it builds one ``PageLoader`` once
``register_kv_caches`` succeeds and submits ``PageLoader.load`` for each load the
scheduler's metadata names; ``ids_from`` and ``layer_rows`` are shared with its save path."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from client.gets.landing import Landing, choose_landing
from client.gets.plan import device_plan, found_plan, spans_plan, units_plan
from client.log_limit import LogLimit
from client.memory.device_rows import DeviceRows
from client.memory.layer_feed import LayerFeed
from client.paging.page_source import PageSource
from client.paging.paged_cache import PagedCache
from client.paging.specs import LoadSpec
from client.paging.staging_pool import StagingPool
from kvstore.errors import CredentialError
from kvstore.pages import heads

# Logged under the worker's name, as before the load path had a module of its own.
log = logging.getLogger("client.vllm.worker")
# faults repeat with every load: a WARNING at most once a minute, the others at DEBUG
LOAD_LOG = LogLimit(log)


@dataclass
class LoadOutcome:
    """One load's result, as ``PageLoader.load`` returns it to ``get_finished``: the
    block ids vLLM recomputes, the bytes written into the cache and the seconds taken."""

    failed: list[int]
    nbytes: int
    seconds: float


def ids_from(spec: LoadSpec, position: int) -> list[int]:
    """The block ids ``spec`` fills from ``position`` on, of every group (vLLM recomputes
    a request from its first block reported failed); never the null block 0."""
    groups = spec.group_block_ids or [spec.block_ids]
    return [b for ids in groups for b in ids[position:] if b]


def load_outcome(
    spec: LoadSpec, got: int, page_nbytes: int, started: float, nbytes: int | None = None
) -> LoadOutcome:
    """A load's outcome: blocks ``got`` on failed (logged at most once a minute), the
    bytes of those before them (``nbytes`` when given: a hybrid load's rows differ in
    size), the seconds since ``started``."""
    good = max(got, spec.start_block)
    failed = ids_from(spec, good)
    if failed:
        LOAD_LOG.warning(
            "blocks recomputed",
            "request %s: %d of %d blocks could not be loaded and will be recomputed",
            spec.req_id,
            len(failed),
            len(spec.block_ids) - spec.start_block,
        )
    if nbytes is None:
        nbytes = (good - spec.start_block) * page_nbytes
    return LoadOutcome(failed, nbytes, time.perf_counter() - started)


# Bytes a copy into a block-major cache's blocks must average (a copy per run of
# consecutive blocks) for pages to land there rather than in rows scattered after: on
# an H200 128 separate copies of 2 MiB ran at 0.93x of one (shared/reference/gpu-h200.md),
# which landing in place repays by skipping the scatter and its wait; copies of 64 KiB
# are issued slower than the bus carries them, so small scattered pages keep the rows.
IN_PLACE_COPY_BYTES = 1 << 20


def copies_pay(rows: DeviceRows) -> bool:
    """Whether pages landing in ``rows`` (a cache's blocks), a copy per run of rows
    that lie back to back, average at least ``IN_PLACE_COPY_BYTES`` a copy."""
    runs = 1 + int(np.count_nonzero(np.diff(rows.offsets) != rows.nbytes))
    return len(rows) * rows.nbytes >= runs * IN_PLACE_COPY_BYTES


def layer_rows(
    layer_groups: list[int], group_block_ids: list[list[int]], first: int, count: int
) -> list[tuple[list[int], list[int]]]:
    """Per layer (``layer_groups``: each layer's KV-cache group), the rows ``0..count-1``
    (positions ``first`` on) and their blocks in the layer's group, skipping positions
    where that group has the null block 0 (a sliding group below its window: vLLM keeps
    no block there)."""
    per_group = []
    for ids in group_block_ids:
        pairs = [(i, b) for i, b in enumerate(ids[first : first + count]) if b]
        per_group.append(([i for i, _ in pairs], [b for _, b in pairs]))
    return [per_group[g] for g in layer_groups]


class PageLoader:
    """Loads one request's stored blocks into a registered worker's paged cache: its one
    job. ``load`` runs on a loader thread and never raises; the worker owns the threads,
    the client's lifetime and the load errors it reports to vLLM."""

    def __init__(
        self,
        client: PageSource,
        cache: PagedCache,
        staging: StagingPool,
        *,
        block_size: int,
        layer_groups: list[int],
        load_stream: Any,
        credential_refused: Callable[[CredentialError], None],
    ) -> None:
        self._client = client
        self._cache = cache
        self._staging = staging
        self._block_size = block_size
        # Hybrid KV-cache groups: the group of each layer of the cache; empty for one group.
        self._layer_groups = layer_groups
        self._load_stream = load_stream  # a CUDA side stream on a GPU, else None
        self._credential_refused = credential_refused
        # pages land straight in device memory (a ``device_plan``); hybrid
        # groups stage (a page's layers go to different groups' blocks)
        # (asked here, at registration: on a GPU it checks the device checksums once,
        # compiling them, so the first load does not wait for that)
        self._on_device = not layer_groups and client.lands_on_device(cache.device)
        # and layer by layer (``client.paging.layerwise``) where the copier can
        self.feeds_layers = self._on_device and client.lands_layers(cache.device)

    def beside(self, client: PageSource, cache: PagedCache, staging: StagingPool) -> PageLoader:
        """A loader of other layers (a speculative draft's) stored under ``client``'s
        namespace, in ``cache``, with this one's block size, load stream and credential
        handling, in one KV-cache group."""
        return PageLoader(
            client,
            cache,
            staging,
            block_size=self._block_size,
            layer_groups=[],
            load_stream=self._load_stream,
            credential_refused=self._credential_refused,
        )

    def load(self, spec: LoadSpec, after: Any) -> LoadOutcome:
        """Loader thread: fetch, verify and scatter one request's blocks. Never raises:
        whatever did not arrive is listed as failed."""
        started = time.perf_counter()
        client, cache, staging = self._client, self._cache, self._staging
        wanted = spec.block_ids[spec.start_block :]
        got = spec.start_block
        pages = None
        taken: list[torch.Tensor] = []
        try:
            if self._layer_groups:
                got, nbytes = self._load_hybrid(spec, after, taken)
                return load_outcome(spec, got, 0, started, nbytes)
            # how pages land: the client's gets choose the same way (client.gets.landing)
            landing, spans = choose_landing(
                client.heads, lambda: cache.block_spans(wanted), self._on_device
            )
            if landing is Landing.DEVICE:
                # Device memory: straight from the nodes' memory (DMA from registered
                # mappings on the same host), checked on the device. Into a block-major
                # cache (BLHNC) each page lands in its own block: no scratch, no
                # scatter; a block whose page failed its check is reported failed, with
                # every block after it, so vLLM recomputes over its bytes before any
                # layer reads them. Into any other byte order the pages land in device
                # rows and are scattered into the blocks once checked, so bytes that
                # failed never reach the cache. Measured on an H200
                # (shared/reference/gpu-h200.md, probe2): one H2D plus a per-layer
                # device reorder into FlashAttention's default LBNHC 48.4 GB/s; one
                # copy per page into a BLHNC cache 50.9 GB/s.
                placed = cache.device_rows(wanted)
                rows: torch.Tensor | DeviceRows
                scratch = None
                if placed is not None and copies_pay(placed):
                    rows = placed
                else:
                    rows = scratch = torch.empty(
                        (len(wanted), *cache.page_shape), dtype=cache.dtype, device=cache.device
                    )
                got = (
                    client.read(
                        device_plan(
                            spec.found,
                            rows,
                            start_block=spec.start_block,
                            after=after if scratch is None else None,  # else the scatter waits
                        )
                    )
                    // self._block_size
                )
                parts = (
                    [] if scratch is None else [(scratch[: max(got - spec.start_block, 0)], 0, 0)]
                )
            elif landing is Landing.IN_PLACE:
                # Straight into the cache's blocks: from the node's mapped slots with one
                # copy on the same host (no host page buffer, no scatter); over UCX in
                # place when the cache is block-major, else through one scratch copy;
                # verified before get_finished reports the load.
                # Measured, 96 pages of 1.25 MiB (the TTFT bench's 120 MiB) into a
                # 10-layer CPU cache, 10 rounds interleaved: 22.0 ms (20.2-28.2) against
                # 29.5 ms (25.3-42.0) through a staging buffer and scatter.
                got = (
                    client.read(spans_plan(spec.found, spans or [], start_block=spec.start_block))
                    // self._block_size
                )
                parts = []
            elif landing is Landing.STAGED:
                pages = staging.take_pages(len(spec.block_ids))
                got = (
                    client.read(found_plan(spec.found, pages, start_block=spec.start_block))
                    // self._block_size
                )
                parts = [(pages[spec.start_block : got], 0, 0)]
            else:  # Landing.UNITS
                # Head groups: this rank's heads go from the fetched units straight into the
                # cache, from one buffer of the pool (no client staging, no merge into rank
                # pages). Measured, a TP=1 load of 96 blocks (60 MiB) stored by TP=2 ranks,
                # same host, 8 rounds interleaved: 17.7 ms against 22.2 ms merging first.
                units_pages = -(
                    -client.units_nbytes(spec.found.blocks - spec.start_block)
                    // client.namespace.page_nbytes
                )
                pages = staging.take_pages(units_pages)
                units, blocks = client.read(
                    units_plan(spec.found, pages, start_block=spec.start_block)
                )
                got = spec.start_block + blocks
                # units is None only with blocks 0 (a fault or the deadline)
                parts = (
                    heads.rank_parts(client.namespace, units[:, :blocks], client.heads)
                    if blocks and units is not None
                    else []
                )
            if got > spec.start_block:
                if after is not None:
                    self._load_stream.wait_event(after)
                for part, head_at, layer_at in parts:
                    cache.scatter(
                        part,
                        spec.block_ids[spec.start_block : got],
                        self._load_stream,
                        head_at=head_at,
                        layer_at=layer_at,
                    )
        except CredentialError as exc:
            self._credential_refused(exc)
            got = spec.start_block
        except Exception as exc:
            LOAD_LOG.warning("load failed", "load of %s failed: %s", spec.req_id, exc)
            got = spec.start_block
        finally:
            for held in ([pages] if pages is not None else []) + taken:
                staging.give_pages(held)
        return load_outcome(spec, got, client.namespace.page_nbytes, started)

    def feed(self, spec: LoadSpec, rows: torch.Tensor, feed: LayerFeed) -> int:
        """Loader thread: a layer-wise load's get, ``spec``'s pages into ``rows`` layer by
        layer through ``feed`` (``client.paging.layerwise`` scatters each layer as the
        forward reaches it). Returns the blocks that arrived (from 0); never raises, and
        closes ``feed`` whatever happens."""
        try:
            got = self._client.read(device_plan(spec.found, rows, spec.start_block, feed))
            return got // self._block_size
        except CredentialError as exc:
            self._credential_refused(exc)
        except Exception as exc:
            LOAD_LOG.warning("load failed", "load of %s failed: %s", spec.req_id, exc)
        finally:
            feed.close()
        return spec.start_block

    def _load_hybrid(
        self, spec: LoadSpec, after: Any, taken: list[torch.Tensor]
    ) -> tuple[int, int]:
        """Loader thread, hybrid groups: fetch whole pages (one block of every layer, as
        any engine of the model stores them) and write each layer's part into its own
        group's blocks, leaving out a sliding layer's positions below its window (vLLM
        gave those the null block: the layer never reads them). Returns the blocks that
        arrived (from 0) and the bytes written into the cache; the staging pages it takes
        are put in ``taken`` for the caller to give back, whatever happens. Never in
        place: a page's layers go to different groups' blocks."""
        client, cache, staging = self._client, self._cache, self._staging
        count = spec.found.blocks - spec.start_block
        if client.heads.identity:
            pages = staging.take_pages(spec.found.blocks)
            taken.append(pages)
            got = (
                client.read(found_plan(spec.found, pages, start_block=spec.start_block))
                // self._block_size
            )
            parts = [(pages[spec.start_block : got], 0, 0)]
        else:  # head groups: this rank's heads of each layer range, as Landing.UNITS
            units_pages = -(-client.units_nbytes(count) // client.namespace.page_nbytes)
            pages = staging.take_pages(units_pages)
            taken.append(pages)
            units, blocks = client.read(units_plan(spec.found, pages, start_block=spec.start_block))
            if units is None:  # a fault or the deadline: nothing arrived
                return spec.start_block, 0
            got = spec.start_block + blocks
            parts = (
                heads.rank_parts(client.namespace, units[:, :blocks], client.heads)
                if blocks
                else []
            )
        nbytes = 0
        if got > spec.start_block:
            if after is not None:
                self._load_stream.wait_event(after)
            rows = layer_rows(
                self._layer_groups, spec.group_block_ids, spec.start_block, got - spec.start_block
            )
            for part, head_at, layer_at in parts:
                nbytes += cache.scatter_layers(
                    part, rows, self._load_stream, head_at=head_at, layer_at=layer_at
                )
        return got, nbytes
