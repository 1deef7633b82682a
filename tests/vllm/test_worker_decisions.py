"""The connector's worker decisions in the fast tier: the real ``ConnectorWorker`` (its
loader, saver and pin threads, the load path, load errors, layer-wise feeds, P/D waits)
over a ``MemoryStore`` (tests/support/memory_store.py), which lands real page bytes
where a get's plan says and keeps a worker's puts under the same keys as the nodes
(head-group units included). Through vLLM's real ``Scheduler``
(tests/support/connector_harness.py) where the harness's engine has the feature (a
TP=1 engine of two head groups); driven directly (``register_kv_caches``,
``start_load_kv``, ``wait_for_save``, ``get_finished``; tests/support/worker_harness.py)
for a draft's layers and hybrid groups, whose engines the harness's stand-in model does
not compute. The ranks of a TP=2 engine are test_worker_head_groups.py's. What needs
real nodes (transfers, faults, device copies) stays in the ``test_vllm*`` files."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

from client.paging.specs import LoadSpec, SaveSpec
from client.vllm.drafts import DraftFacts
from client.vllm.metadata import KVStoreConnectorMetadata
from client.vllm.transfer_params import announcement
from kvstore.pages.heads import unit_hashes
from kvstore.pages.identity import NO_EXTRAS
from tests.support.connector_harness import (
    BLOCK,
    HEAD,
    KV_HEADS,
    LAYERS,
    PROMPT_A,
    ConnectorHarness,
    attention_config,
)
from tests.support.harness_fixtures import model_dir, store  # noqa: F401 (fixtures)
from tests.support.memory_store import MemoryStore
from tests.support.worker_harness import BLOCKS, engine_config, finish_load, saved, worker_over

A_HIT = (len(PROMPT_A) - 1) // BLOCK * BLOCK  # 6 blocks: one prompt token is computed
A_BLOCKS = A_HIT // BLOCK


def engine(model_dir: str, store: MemoryStore, **kw) -> ConnectorHarness:
    extra = kw.pop("extra", None)
    return ConnectorHarness(model_dir, None, store=store, extra=extra, **kw)


def stored_a(model_dir: str, store: MemoryStore) -> list[int]:
    """PROMPT_A computed and saved by a first engine: the tokens it generated."""
    with engine(model_dir, store) as first:
        return first.generate({"a": PROMPT_A})["a"].tokens


# ---- through vLLM's Scheduler -----------------------------------------------------------


def test_a_hit_lands_the_stored_bytes_in_its_own_blocks(model_dir, store):
    computed = stored_a(model_dir, store)
    with engine(model_dir, store) as second:
        second.add("a", PROMPT_A)
        while second.scheduler.requests["a"].num_computed_tokens < len(PROMPT_A):
            second.step()
        # every loaded position's KV, in the blocks vLLM gave this request, every layer
        assert second.check_cache("a", PROMPT_A, len(PROMPT_A)) == []
        out = second.run()
        assert second.metrics()["load_bytes"] == A_BLOCKS * second.lookups.namespace.page_nbytes
    assert out["a"].num_cached_tokens == A_HIT and out["a"].tokens == computed
    assert "IntoSpans" in store.reads  # straight into the cache's blocks (in place)


def test_a_page_evicted_after_the_lookup_is_reported_to_vllm_and_recomputed(model_dir, store):
    """The lookup found 6 blocks; block 3 is gone when the worker fetches: the worker
    reports blocks 3 on as load errors (``get_block_ids_with_load_errors``), vLLM
    recomputes them, and the tokens are those computing the prompt gives."""
    computed = stored_a(model_dir, store)
    with engine(model_dir, store) as second:
        store.evict_on_read([second.lookups.chain(PROMPT_A)[3]])
        second.add("a", PROMPT_A)
        out = second.run()
        assert second.metrics()["load_failed_blocks"] == A_BLOCKS - 3
    assert out["a"].tokens == computed  # blocks 3 on recomputed over what was loaded


GROUPS = {"head_groups": 2}  # a unit per KV head: what engines of TP 1 and 2 share


def test_a_tp1_engine_of_two_head_groups_loads_both_units_into_its_blocks(model_dir, store):
    """head_groups=2 on a TP=1 engine: its saves keep each block as two units, one KV
    head each, and a second engine's worker, whose page is not one unit, reads both
    into a buffer (``IntoUnits``) and writes each unit's head into its own blocks."""
    with engine(model_dir, store, extra=GROUPS) as first:
        computed = first.generate({"a": PROMPT_A})["a"].tokens
    assert len(store) == 2 * len(PROMPT_A) // BLOCK  # two units per full block
    with engine(model_dir, store, extra=GROUPS) as second:
        second.add("a", PROMPT_A)
        while second.scheduler.requests["a"].num_computed_tokens < len(PROMPT_A):
            second.step()
        assert second.check_cache("a", PROMPT_A, len(PROMPT_A)) == []  # every head
        out = second.run()
        metrics = second.metrics()
        assert metrics["load_bytes"] == A_BLOCKS * second.lookups.namespace.page_nbytes
    assert out["a"].num_cached_tokens == A_HIT and out["a"].tokens == computed
    assert metrics["load_failed_blocks"] == 0 and store.reads == ["IntoUnits"]


def test_a_unit_evicted_after_the_lookup_ends_the_loaded_prefix_at_its_block(model_dir, store):
    """Both units of 6 blocks were found; block 3's second unit (the second KV head)
    is gone when the worker fetches: blocks 3 on are reported failed and recomputed,
    so no block is left with one head loaded and the other stale."""
    with engine(model_dir, store, extra=GROUPS) as first:
        computed = first.generate({"a": PROMPT_A})["a"].tokens
    with engine(model_dir, store, extra=GROUPS) as second:
        store.evict_on_read(unit_hashes(second.lookups.chain(PROMPT_A)[3:4], 1, 1))
        second.add("a", PROMPT_A)
        while second.scheduler.requests["a"].num_computed_tokens < len(PROMPT_A):
            second.step()
        assert second.check_cache("a", PROMPT_A, len(PROMPT_A)) == []
        out = second.run()
        assert second.metrics()["load_failed_blocks"] == A_BLOCKS - 3
    assert out["a"].tokens == computed


def test_layerwise_loads_feed_each_layer_before_it_is_read(model_dir):
    store = MemoryStore(device=True)  # the host as the device: gets land layer by layer
    computed = stored_a(model_dir, store)
    with engine(model_dir, store, extra={"layerwise_loads": "on"}) as second:
        out = second.generate({"a": PROMPT_A})
    assert out["a"].num_cached_tokens == A_HIT and out["a"].tokens == computed
    assert store.reads.count("IntoLayers") == 1


def test_a_layerwise_load_whose_page_is_gone_recomputes_from_it(model_dir):
    store = MemoryStore(device=True)
    computed = stored_a(model_dir, store)
    with engine(model_dir, store, extra={"layerwise_loads": "on"}) as second:
        store.evict_on_read([second.lookups.chain(PROMPT_A)[2]])
        out = second.generate({"a": PROMPT_A})
        assert second.metrics()["load_failed_blocks"] == A_BLOCKS - 2
    assert out["a"].tokens == computed and store.reads == ["IntoLayers"]


def test_a_forward_that_never_waits_for_its_layers_recomputes_the_load(model_dir):
    store = MemoryStore(device=True)
    computed = stored_a(model_dir, store)
    extra = {"layerwise_loads": "on"}
    with engine(model_dir, store, extra=extra, layer_waits=False) as second:
        out = second.generate({"a": PROMPT_A})
        assert second.metrics()["load_failed_blocks"] == A_BLOCKS
    assert out["a"].tokens == computed


def test_a_decode_waits_for_the_announced_prefix_then_loads_it(model_dir, store):
    """P/D: the prefill's pages reach the store 0.3 s after the decode's request; the
    decode's worker polls for them (``client.paging.awaiting``) and loads them."""
    early = MemoryStore()
    computed = stored_a(model_dir, early)
    params = announcement(BLOCK, PROMPT_A, NO_EXTRAS, len(PROMPT_A) // BLOCK)
    with engine(model_dir, store) as decode:
        arrive = threading.Timer(0.3, store.copy_from, (early,))
        started = time.monotonic()
        arrive.start()
        decode.add("a", PROMPT_A, **params)
        out = decode.run()
        waited = time.monotonic() - started
        metrics = decode.metrics()
    assert out["a"].num_cached_tokens == A_HIT and out["a"].tokens == computed
    assert metrics["remote_prefills_in_time"] == 1 and waited >= 0.3
    assert metrics["remote_prefill_lookups"] >= 2  # asked again until the pages came


def test_an_announced_prefix_never_stored_is_recomputed_after_the_wait(model_dir, store):
    computed = stored_a(model_dir, MemoryStore())
    params = announcement(BLOCK, PROMPT_A, NO_EXTRAS, len(PROMPT_A) // BLOCK)
    with engine(model_dir, store, extra={"remote_prefill_wait_ms": 50}) as decode:
        decode.add("a", PROMPT_A, **params)
        out = decode.run()
        metrics = decode.metrics()
    assert out["a"].tokens == computed and out["a"].num_cached_tokens == 0
    assert metrics["remote_prefill_deadline_misses"] == 1


# ---- the worker alone (tests/support/worker_harness.py): a draft's layers, hybrid groups --


def test_a_drafts_pages_are_saved_and_loaded_beside_the_targets(model_dir, store):
    """A speculative draft's layers (``client.vllm.drafts``): a save stores the draft's
    pages under its own namespace with the target's; a load fills both caches' blocks."""
    config = engine_config(
        model_dir,
        speculative_config={
            "method": "draft_model",
            "model": model_dir,
            "num_speculative_tokens": 1,
        },
    )
    target = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    drafts = [f"draft_model.model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    groups = attention_config(target + drafts, BLOCKS)
    facts = DraftFacts(drafts, "draft_model", 0)
    source = worker_over(store, config, groups, target + drafts, drafts=facts)
    tokens = PROMPT_A[:A_HIT]
    saved(source, KVStoreConnectorMetadata(saves=[SaveSpec("s", tokens, [1, 2, 3, 4, 5, 6])]))
    assert len(store) == 2 * A_BLOCKS  # the target's pages and the draft's
    source.shutdown()

    loader = worker_over(store, config, groups, target + drafts, drafts=facts)
    target_pages, draft_pages = store.opened[-2:]
    found, draft_found = target_pages.find(tokens), draft_pages.find(tokens)
    assert found is not None and draft_found is not None and found.blocks == A_BLOCKS
    into = [9, 10, 11, 12, 13, 14]
    spec = LoadSpec("a", found, into, 0, draft_found=draft_found)
    loader.start_load_kv(KVStoreConnectorMetadata(loads=[spec]))
    assert finish_load(loader, "a") == set()
    for name in target + drafts:
        assert torch.equal(loader.caches[name][into], source.caches[name][1:7]), name
    loader.shutdown()


def hybrid_config(full: list[str], sliding: list[str]) -> KVCacheConfig:
    """Two KV-cache groups: full attention, and a sliding window of one block."""
    spec = attention_config(full, BLOCKS).kv_cache_groups[0].kv_cache_spec
    window = SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        dtype=torch.float32,
        sliding_window=BLOCK,
    )
    size = spec.page_size_bytes * BLOCKS
    return KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size, [n], layer_stride=size, block_stride=spec.page_size_bytes)
            for n in full + sliding
        ],
        kv_cache_groups=[KVCacheGroupSpec(full, spec), KVCacheGroupSpec(sliding, window)],
    )


def test_a_hybrid_load_writes_each_layer_into_its_own_groups_blocks(model_dir, store):
    """Hybrid groups (``client.paging.loader.layer_rows``): a page holds every layer's
    block; each layer's part lands in its own group's block of the position, and a
    sliding group's positions below its window (the null block 0) are left alone."""
    config = engine_config(model_dir)
    full, sliding = ["model.layers.0.self_attn.attn"], ["model.layers.1.self_attn.attn"]
    worker = worker_over(store, config, hybrid_config(full, sliding), full + sliding)
    pages = store.opened[-1]
    page_nbytes = pages.namespace.page_nbytes
    tokens = PROMPT_A[: 4 * BLOCK]
    stored = [bytes(torch.full((page_nbytes // 4,), float(i)).numpy().tobytes()) for i in range(4)]
    pages.put(tokens, stored)
    found = pages.find(tokens)
    assert found is not None
    before = {n: t.clone() for n, t in worker.caches.items()}
    full_ids, sliding_ids = [2, 3, 4, 5], [0, 0, 7, 8]
    spec = LoadSpec("h", found, full_ids, 0, group_block_ids=[full_ids, sliding_ids])
    worker.start_load_kv(KVStoreConnectorMetadata(loads=[spec]))
    assert finish_load(worker, "h") == set() and worker.take_failed_loads() == set()
    first, second = worker.caches[full[0]], worker.caches[sliding[0]]
    for pos in range(4):
        assert torch.all(first[full_ids[pos]] == float(pos))
    for pos in (2, 3):
        assert torch.all(second[sliding_ids[pos]] == float(pos))
    assert torch.equal(second[0], before[sliding[0]][0])  # the null block: never written
    worker.shutdown()
