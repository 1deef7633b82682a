"""Loads fed to the forward pass layer by layer (``LayerwiseLoads``): what a GPU engine's
sync loads use, so that a request's stored KV crosses the bus beside the forward pass
that reads it instead of before it.

The worker's step: ``start`` (before the forward) gives each load's get to a loader
thread, landing the pages in device rows one layer at a time
(``client.memory.layer_feed``); ``wait_layer`` (before layer ``l`` reads the cache) makes
the engine's stream wait for that layer's copies and queues that layer's scatter from the
rows into the request's blocks on it; ``finish`` (once the forward is queued) waits for
the gets, whose checks ran beside the forward, and names the blocks to recompute: every
block from the first one that failed its check, did not arrive, or whose layer was not in
place when the forward took it. The engine then drops what the step sampled from them
(vLLM does for sync loads), so a bad page costs a recompute, never wrong output.

Measured on an NVIDIA H200 (bench/gpu_check.py section 3: 32 layers of a synthetic
Llama-8B over 4,096 tokens, 512 MiB of KV stored as 2 MiB pages): the forward alone
82.8 ms; the connector's whole load from the store, then the forward, 98.0 ms; this
path, the load in the forward, 89.8 ms (1.08x). Loads this cannot feed layer by layer
(no device copier, head groups, hybrid groups, a draft's pages) are loaded whole here
before the forward starts, as the scheduler promised vLLM."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import torch

from client.memory.layer_feed import LayerFeed
from client.paging.loader import LoadOutcome, PageLoader, load_outcome
from client.paging.paged_cache import PagedCache
from client.paging.specs import LoadSpec

log = logging.getLogger("client.vllm.worker")


@dataclass
class _Fed:
    """One load being fed: its rows (device pages), feed, get and block index."""

    spec: LoadSpec
    rows: torch.Tensor
    feed: LayerFeed
    got: Future[int]
    index: torch.Tensor
    started: float


class LayerwiseLoads:
    """A worker's sync loads of one step. Engine thread only; ``loader``'s gets run on
    ``threads``; ``whole`` loads a spec entirely, in the caller's thread (the worker's own
    load, drafts included) when it cannot be fed (or ``feeds`` is False); ``timeout``: the client's, which bounds
    every wait here; ``layer_index``: the cache's layer of each engine layer name."""

    def __init__(
        self,
        loader: PageLoader,
        cache: PagedCache,
        threads: Executor,
        whole: Callable[[LoadSpec, Any], LoadOutcome],
        *,
        feeds: bool,
        timeout: float,
        layer_index: dict[str, int],
    ) -> None:
        self._loader = loader
        self._cache = cache
        self._threads = threads
        self._whole = whole
        self._feeds = feeds and loader.feeds_layers
        self._timeout = timeout
        self._layer_index = layer_index  # the engine's layer names: the cache's layers
        self._fed: list[_Fed] = []
        self._done: list[tuple[LoadSpec, LoadOutcome]] = []
        self._warned = False  # the line about loads that cannot be fed

    def start(self, spec: LoadSpec, after: Any) -> None:
        """Before the forward: start ``spec``'s load, fed layer by layer where it can be,
        else loaded whole before this returns (``after``: the event the worker's load
        stream waits for)."""
        blocks = spec.block_ids[spec.start_block :]
        if not self._feeds or not blocks:
            if blocks and not self._warned:
                self._warned = True
                log.warning(
                    "layer-wise loads are on, but this worker lands pages whole (no device "
                    "copier with 2-D copies, head groups, hybrid groups or a draft): each "
                    "such load holds up its step until it is done; layerwise_loads=off lets "
                    "them run beside the steps instead (logged once)"
                )
            self._done.append((spec, self._whole(spec, after)))
            return
        cache = self._cache
        if cache.outside(blocks):
            log.warning("load of %s names blocks outside the cache: %s", spec.req_id, blocks[:4])
            self._done.append((spec, load_outcome(spec, spec.start_block, 0, time.perf_counter())))
            return
        rows = torch.empty((len(blocks), *cache.page_shape), dtype=cache.dtype, device=cache.device)
        feed = LayerFeed(cache.page_shape[0], len(blocks))
        index = torch.tensor(blocks, dtype=torch.long).to(cache.device, non_blocking=True)
        got = self._threads.submit(self._loader.feed, spec, rows, feed)
        self._fed.append(_Fed(spec, rows, feed, got, index, time.perf_counter()))

    def wait_layer(self, layer_name: str) -> None:
        """Before the layer ``layer_name`` reads the cache: the engine's current stream
        waits for that layer of every load being fed, then writes it into the blocks
        (a layer not in the cache, a draft's, has nothing here)."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for fed in self._fed:
            left = fed.started + self._timeout - time.perf_counter()
            events = fed.feed.take(layer, max(left, 0.0))
            if fed.rows.device.type == "cuda":
                stream = torch.cuda.current_stream(fed.rows.device)
                for event in events:
                    stream.wait_event(event)
            self._cache.layers[layer].index_copy_(0, fed.index, fed.rows[:, layer])

    def finish(self) -> list[tuple[LoadSpec, LoadOutcome]]:
        """Once the forward is queued: each load of the step and its outcome (every
        block from the first bad one on failed, see the module's docstring)."""
        done, self._done = self._done, []
        fed, self._fed = self._fed, []
        for load in fed:
            spec = load.spec
            got = load.got.result()  # bounded: the get ends by the client's timeout
            untaken = load.feed.untaken()
            if untaken:
                # the forward read those layers without their KV: all of it is recomputed,
                # and this engine's later loads come whole, before the forward (its
                # attention layers do not call wait_for_layer_load)
                log.warning(
                    "request %s: the forward never waited for layers %s; its load is "
                    "recomputed, and later loads are made whole before the forward",
                    spec.req_id,
                    untaken[:4],
                )
                self._feeds = False
                got = spec.start_block
            good = min(got, spec.start_block + load.feed.first_late())
            done.append((spec, load_outcome(spec, good, self._cache.page_nbytes, load.started)))
        return done
