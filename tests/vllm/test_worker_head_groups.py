"""The connector's worker, as the ranks of one TP size reading what another TP size
saved, in the fast tier: head-group units (``kvstore.pages.heads``) land in the heads
each rank holds, byte for byte over random caches, a missing unit ends that rank's
prefix at its block, and a rank of fewer head groups than its TP size reads its half of
whole pages and stores nothing. The worker runs over a ``MemoryStore``
(tests/support/memory_store.py, tests/support/worker_harness.py)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from client.paging.specs import LoadSpec, SaveSpec
from client.vllm.connector import KVStoreConnector
from client.vllm.metadata import KVStoreConnectorMetadata
from client.vllm.worker import ConnectorWorker
from kvstore.pages.hashing import split_hashes
from kvstore.pages.heads import unit_hashes
from tests.support.connector_harness import BLOCK, LAYERS, PROMPT_A, PROMPT_C, attention_config
from tests.support.harness_fixtures import model_dir, store  # noqa: F401 (fixtures)
from tests.support.memory_store import MemoryStore
from tests.support.worker_harness import BLOCKS, engine_config, finish_load, saved, worker_over

A_HIT = (len(PROMPT_A) - 1) // BLOCK * BLOCK  # 6 blocks: one prompt token is computed
A_BLOCKS = A_HIT // BLOCK
GROUPS = {"head_groups": 2}  # a unit per KV head: what engines of TP 1 and 2 share

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


class _Warnings(logging.Handler):
    """The WARNING lines a logger writes (the connector's loggers do not propagate to
    pytest's: they take vLLM's handlers, ``client.vllm.connector.adopt_vllm_logging``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("groups", [1, 2])
def test_an_engine_whose_ranks_hold_part_of_a_head_group_makes_no_saves_and_says_why(
    model_dir, store, groups
):
    """The engine above, as its scheduler starts (``client.vllm.support.save_refusal``):
    with head_groups=1 its ranks could never write a page, so it schedules no saves and
    says why in one WARNING line, where every save used to fail and be counted; it
    still looks up and loads. With head_groups=2 it saves."""
    two = engine_config(model_dir, tensor_parallel_size=2)
    two.kv_transfer_config.kv_connector_extra_config["head_groups"] = groups
    logger, warnings = logging.getLogger("client.vllm.connector"), _Warnings()
    logger.addHandler(warnings)
    try:
        connector = KVStoreConnector(
            two, KVConnectorRole.SCHEDULER, attention_config(TARGET, BLOCKS), stores=store.client
        )
    finally:
        logger.removeHandler(warnings)
    warned = [line for line in warnings.lines if "makes no saves" in line]
    scheduler = connector._scheduler
    assert scheduler is not None and scheduler._client is not None  # it looks up
    connector.shutdown()
    if groups == 1:
        assert warned == [
            "KVStoreConnector: this engine makes no saves: head_groups 1 stores 2 KV heads in "
            "a page, and each of its 2 TP ranks holds 1: it loads whole pages but cannot write "
            "one (head_groups 2, the default for this engine, or a multiple of it that divides "
            "the KV heads, the same on every engine sharing the pages, lets it save)"
        ]
        assert not scheduler._saves_enabled
    else:
        assert warned == [] and scheduler._saves_enabled
