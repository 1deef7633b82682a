"""A step's saves copied out of the paged cache, on the engine thread, and handed to the
saver thread (``client.vllm.saver.SaveQueue``): each save's blocks gathered into staging
buffers (on a GPU into a device scratch on the compute stream, so later steps may reuse
the blocks), the draft's blocks beside the target's, and a hybrid cache's pages gathered
step by step (``client.vllm.gathered``) taken whole.

Called by ``client.vllm.worker.ConnectorWorker.wait_for_save`` once the worker is
registered and writes the heads it holds. Guarantees: every save of the step is either
submitted (its pages copied, its bytes within ``max_pending_save_bytes``) or reported
failed in the save outcomes (its KV event withheld) at once; nothing waits for room."""

from __future__ import annotations

import time

from client.paging.paged_cache import PagedCache
from client.paging.staging_pool import StagingPool
from client.vllm.drafts import DraftPages
from client.vllm.gathered import GatheredPages
from client.vllm.metadata import KVStoreConnectorMetadata
from client.vllm.saver import SaveQueue
from client.vllm.stats import StatsRecorder
from client.vllm.store import PageStore


def copy_out_saves(
    meta: KVStoreConnectorMetadata,
    client: PageStore,
    cache: PagedCache,
    staging: StagingPool,
    saves: SaveQueue,
    stats: StatsRecorder,
    *,
    gathered: GatheredPages | None,
    draft: DraftPages | None,
) -> None:
    """``meta``'s gathers and saves: the pages of each copied out of ``cache`` (and the
    draft's cache) into ``staging`` and submitted to ``saves`` for ``client`` to publish;
    ``gathered``: a hybrid cache's pages held since earlier steps; ``draft``: the draft
    model's pages, stored apart, None without one."""
    if gathered is not None:
        for gather in meta.gathers:
            gathered.gather(gather)
    page_nbytes = client.namespace.page_nbytes
    for spec in meta.saves:
        if spec.gathered:
            held = gathered.take(spec.req_id) if gathered is not None else None
            if held is None:  # a gather was dropped (pending bytes): nothing to publish
                saves.outcomes.report([spec], ok=False)
                continue
            nbytes = len(held.pages) * page_nbytes
            saves.submit(client, staging, spec, held, nbytes)
            continue
        nbytes = len(spec.block_ids) * page_nbytes
        draft_nbytes = len(spec.block_ids) * draft.client.namespace.page_nbytes if draft else 0
        if not saves.reserve(spec.req_id, nbytes + draft_nbytes):
            saves.outcomes.report([spec], ok=False)
            continue
        started = time.perf_counter()
        pages = cache.gather(spec.block_ids, staging.take_pages(len(spec.block_ids)))
        drafted = (
            draft.cache.gather(spec.block_ids, draft.staging.take_pages(len(spec.block_ids)))
            if draft is not None
            else None
        )
        stats.observe("save_gather_seconds", time.perf_counter() - started)
        saves.submit(client, staging, spec, pages, nbytes)
        if draft is not None and drafted is not None:
            # the draft's pages: counted, never in the save's KV event (the target's)
            saves.submit(
                draft.client, draft.staging, spec, drafted, draft_nbytes, answers_event=False
            )
