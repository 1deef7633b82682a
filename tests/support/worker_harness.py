"""The connector's worker alone over a ``MemoryStore`` (tests/support/memory_store.py),
for the fast tests of the worker's decisions (tests/vllm/test_worker_decisions.py,
test_worker_head_groups.py): a stand-in engine's config, a registered worker of any TP
rank whose caches are random, and waiting for its loads and saves."""

from __future__ import annotations

import dataclasses
import time

import torch

from client.vllm.metadata import KVStoreConnectorMetadata
from client.vllm.options import connector_options
from client.vllm.stats import StatsRecorder
from client.vllm.worker import ConnectorWorker
from client.vllm.worker_setup import WorkerFeatures, WorkerStores
from tests.support.connector_harness import BLOCK, HEAD, WEIGHTS
from tests.support.stand_in_model import engine_args

BLOCKS = 16  # blocks of each layer's random cache


def engine_config(model_dir: str, **args):
    """The stand-in engine's config (its connector never opened: the worker is built
    here over the memory store), with ``args`` on top."""
    base = engine_args(
        model_dir, None, None, role="kv_both", extra=None, max_batched=2048, events_endpoint=None
    )
    return dataclasses.replace(base, **args).create_engine_config()


def worker_over(
    store, vllm_config, kv_cache_config, names, *, extra=None, tp_rank=0, **features
) -> ConnectorWorker:
    """A registered worker whose stores are ``store``'s, configured by ``extra``, as TP
    rank ``tp_rank`` of ``vllm_config``'s engine; its caches random (its rank's heads)."""
    conf, options = connector_options(
        {
            "redis_url": "redis://in-memory.invalid:6379/0",
            "weights_revision": WEIGHTS,
            **(extra or {}),
        }
    )
    worker = ConnectorWorker(
        vllm_config,
        conf,
        stats=StatsRecorder(),
        stores=WorkerStores(vllm_config, conf, options, opener=store.client),
        features=WorkerFeatures(**features),
        kv_cache_config=kv_cache_config,
        ranks=lambda: (0, tp_rank),
    )
    generator = torch.Generator().manual_seed(len(names))
    heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
    caches = {n: torch.rand(BLOCKS, heads, BLOCK, 2 * HEAD, generator=generator) for n in names}
    worker.register_kv_caches(caches)
    worker.caches = caches  # type: ignore[attr-defined]
    return worker


def finish_load(worker: ConnectorWorker, req_id: str) -> set[int]:
    """Wait for ``req_id``'s load; the blocks reported failed."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, done = worker.get_finished(KVStoreConnectorMetadata(idle=True))
        if done and req_id in done:
            return worker.get_block_ids_with_load_errors() | set()
    raise AssertionError(f"load of {req_id} never finished")


def saved(worker: ConnectorWorker, meta: KVStoreConnectorMetadata) -> None:
    worker.wait_for_save(meta)
    worker._saves.shutdown()  # every save published (and the saver stopped)
