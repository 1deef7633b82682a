"""The connector's worker decisions in the fast tier: the real ``ConnectorWorker`` (its
loader, saver and pin threads, the load path, load errors, layer-wise feeds, P/D waits)
over a ``MemoryStore`` (tests/support/memory_store.py), which lands real page bytes
where a get's plan says and keeps a worker's puts under the same keys as the nodes
(head-group units included). Through vLLM's real ``Scheduler``
(tests/support/connector_harness.py) where the harness's engine has the feature (a
TP=1 engine of two head groups); driven directly (``register_kv_caches``,
``start_load_kv``, ``wait_for_save``, ``get_finished``) for a draft's layers, hybrid
groups and the workers of a TP=2 engine, whose engines the harness's stand-in model
does not compute. Head placement is checked byte for byte over random caches: the
stand-in model writes one value into every head. What needs real nodes (transfers,
faults, device copies) stays in the ``test_vllm*`` files."""

from __future__ import annotations

import dataclasses
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
from client.vllm.options import connector_options
from client.vllm.stats import StatsRecorder
from client.vllm.transfer_params import announcement
from client.vllm.worker import ConnectorWorker
from client.vllm.worker_setup import WorkerFeatures, WorkerStores
from kvstore.pages.hashing import split_hashes
from kvstore.pages.heads import unit_hashes
from kvstore.pages.identity import NO_EXTRAS
from tests.support.connector_harness import (
    BLOCK,
    HEAD,
    KV_HEADS,
    LAYERS,
    PROMPT_A,
    PROMPT_C,
    WEIGHTS,
    ConnectorHarness,
    attention_config,
)
from tests.support.harness_fixtures import model_dir, store  # noqa: F401 (fixtures)
from tests.support.memory_store import MemoryStore
from tests.support.stand_in_model import engine_args

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


# ---- the worker alone: a draft's layers, hybrid groups ---------------------------------

BLOCKS = 16


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


# ---- head groups: TP ranks reading another TP size's units ------------------------------

TARGET = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
SAVED = [1, 2, 3, 4, 5, 6]  # the source's blocks of PROMPT_A's first A_BLOCKS blocks
INTO = [9, 10, 11, 12, 13, 14]  # where a loader's request holds them


def save_a(worker: ConnectorWorker) -> None:
    saved(worker, KVStoreConnectorMetadata(saves=[SaveSpec("s", PROMPT_A[:A_HIT], SAVED)]))


def load_a(worker: ConnectorWorker, store: MemoryStore, evict: int | None = None) -> set[int]:
    """``worker`` loads PROMPT_A's stored blocks into ``INTO`` from the lookup its
    scheduler makes (the storage view: every head group; ``evict``: that unit of block
    3 is gone by the fetch); the blocks it reports failed."""
    ns = store.opened[-1].namespace
    found = store.client(ns.storage).find(PROMPT_A[:A_HIT])
    assert found is not None and found.blocks == A_BLOCKS
    if evict is not None:
        store.evict_on_read(unit_hashes(split_hashes(found.joined)[3:4], evict, 1))
    worker.start_load_kv(KVStoreConnectorMetadata(loads=[LoadSpec("a", found, INTO, 0)]))
    return finish_load(worker, "a")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp2_rank_loads_its_own_head_of_a_tp1_engines_pages(model_dir, store, rank):
    """A TP=1 engine with head_groups=2 saves each block as two units; each worker of a
    TP=2 engine (one KV head) reads the unit of its head, a whole page of its own
    (straight into its blocks), and its cache holds exactly that head of the saved
    blocks, bytes for bytes."""
    one = engine_config(model_dir)
    source = worker_over(store, one, attention_config(TARGET, BLOCKS), TARGET, extra=GROUPS)
    save_a(source)
    assert len(store) == 2 * A_BLOCKS
    source.shutdown()
    two = engine_config(model_dir, tensor_parallel_size=2)
    config = attention_config(TARGET, BLOCKS)
    loader = worker_over(store, two, config, TARGET, extra=GROUPS, tp_rank=rank)
    assert load_a(loader, store) == set()
    for name in TARGET:
        head = source.caches[name][SAVED, rank : rank + 1]
        assert torch.equal(loader.caches[name][INTO], head), name
    assert store.reads == ["IntoSpans"]
    loader.shutdown()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp2_rank_whose_unit_is_gone_loads_up_to_that_block_the_other_all(model_dir, store, rank):
    """Unit 1 of block 3 (the second KV head) is gone after the lookup: rank 1 loads
    blocks 0-2 and reports 3 on failed; rank 0, whose unit is there, loads all six."""
    one = engine_config(model_dir)
    source = worker_over(store, one, attention_config(TARGET, BLOCKS), TARGET, extra=GROUPS)
    save_a(source)
    source.shutdown()
    two = engine_config(model_dir, tensor_parallel_size=2)
    config = attention_config(TARGET, BLOCKS)
    loader = worker_over(store, two, config, TARGET, extra=GROUPS, tp_rank=rank)
    before = {n: t.clone() for n, t in loader.caches.items()}
    failed = load_a(loader, store, evict=1)
    loaded = 3 if rank == 1 else A_BLOCKS
    assert failed == set(INTO[loaded:])
    for name in TARGET:
        head = source.caches[name][SAVED[:loaded], rank : rank + 1]
        assert torch.equal(loader.caches[name][INTO[:loaded]], head), name
        # a failed block is recomputed by vLLM; nothing of another block lands there
        assert torch.equal(loader.caches[name][INTO[loaded:]], before[name][INTO[loaded:]])
    loader.shutdown()


def test_a_tp1_engine_loads_both_heads_of_what_tp2_ranks_saved(model_dir, store):
    """The reverse: each worker of a TP=2 engine saves its KV head as its unit; a TP=1
    engine of the same head groups reads both units of each block (``IntoUnits``) and
    writes each where its head belongs: its cache holds the two ranks' heads side by
    side, bytes for bytes."""
    two = engine_config(model_dir, tensor_parallel_size=2)
    ranks = []
    for rank in (0, 1):
        config = attention_config(TARGET, BLOCKS)
        ranks.append(worker_over(store, two, config, TARGET, extra=GROUPS, tp_rank=rank))
        save_a(ranks[-1])
    assert len(store) == 2 * A_BLOCKS
    one = engine_config(model_dir)
    loader = worker_over(store, one, attention_config(TARGET, BLOCKS), TARGET, extra=GROUPS)
    assert load_a(loader, store) == set()
    for name in TARGET:
        both = torch.cat([r.caches[name][SAVED] for r in ranks], dim=1)
        assert torch.equal(loader.caches[name][INTO], both), name
    assert store.reads == ["IntoUnits"]
    for worker in (*ranks, loader):
        worker.shutdown()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp2_rank_of_one_head_group_reads_its_half_of_whole_pages_and_stores_nothing(
    model_dir, store, rank
):
    """head_groups=1 on a TP=2 engine: a TP=1 engine's pages (its default, one group)
    are one unit of both KV heads, half of which each rank holds; the rank reads the
    whole unit (``IntoUnits``) and writes only its own head into its blocks. It cannot
    store half a group: its save fails, counted, and nothing is stored."""
    one = engine_config(model_dir)
    source = worker_over(store, one, attention_config(TARGET, BLOCKS), TARGET)
    save_a(source)
    assert len(store) == A_BLOCKS
    source.shutdown()
    two = engine_config(model_dir, tensor_parallel_size=2)
    config = attention_config(TARGET, BLOCKS)
    loader = worker_over(store, two, config, TARGET, extra={"head_groups": 1}, tp_rank=rank)
    assert load_a(loader, store) == set()
    for name in TARGET:
        head = source.caches[name][SAVED, rank : rank + 1]
        assert torch.equal(loader.caches[name][INTO], head), name
    assert store.reads == ["IntoUnits"]
    loader._stats.take_stats()  # the load's counts
    saved(loader, KVStoreConnectorMetadata(saves=[SaveSpec("c", PROMPT_C[: 2 * BLOCK], [1, 2])]))
    stats = loader._stats.take_stats()
    assert len(store) == A_BLOCKS and stats is not None and stats.data["save_failures"] == 1
    loader.shutdown()
