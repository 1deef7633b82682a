"""The connector's scheduler decisions in the fast tier: vLLM's real ``Scheduler`` in this
process (tests/support/connector_harness.py) over a ``MemoryStore``
(tests/support/memory_store.py), which keeps real pages under the same chained hashes
as the storage nodes and answers lookups by the same rules. No node, no process: each
test takes well under a second. What needs real nodes (transfers, faults, the breaker's
timing) is in test_vllm_inprocess.py and the other ``test_vllm*`` files."""

from __future__ import annotations

import dataclasses
import logging

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from client.vllm.connector import KVStoreConnector
from client.vllm.feature_set import SchedulerFeatures
from client.vllm.options import connector_options
from client.vllm.scheduler import ConnectorScheduler
from client.vllm.states import StateFacts
from client.vllm.stats import StatsRecorder
from client.vllm.transfer_params import announcement
from kvstore.pages.heads import unit_hashes
from kvstore.pages.identity import NO_EXTRAS, RequestIdentity
from kvstore.pages.namespace import Namespace
from tests.support.connector_harness import (
    BLOCK,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    SHARED,
    ConnectorHarness,
)
from tests.support.harness_fixtures import model_dir, store  # noqa: F401 (fixtures)
from tests.support.memory_store import MemoryStore
from tests.support.stand_in_model import LAYERS, attention_config, engine_args

# the full blocks a lookup may match: one prompt token is always computed
A_HIT = (len(PROMPT_A) - 1) // BLOCK * BLOCK


def engine(model_dir: str, store: MemoryStore, **extra) -> ConnectorHarness:
    return ConnectorHarness(model_dir, None, store=store, extra=extra or None)


def test_a_stored_prefix_is_matched_to_its_last_full_block_and_loads_its_bytes(model_dir, store):
    with engine(model_dir, store) as first:
        computed = first.generate({"a": PROMPT_A})["a"]
    assert computed.num_cached_tokens == 0
    assert len(store) == len(PROMPT_A) // BLOCK  # the save kept every full block's page
    with engine(model_dir, store) as second:
        out = second.generate({"a": PROMPT_A, "b": PROMPT_B})
    assert out["a"].num_cached_tokens == A_HIT  # 6 blocks, not the whole prompt
    assert out["b"].num_cached_tokens == SHARED * BLOCK  # the blocks it shares with A
    # the loaded pages are the KV computing them gives: the same tokens follow
    assert out["a"].tokens == computed.tokens


def test_a_block_missing_one_head_group_ends_the_hit_before_it(model_dir, store):
    """With head groups (a unit per KV head, head_groups=2) the scheduler looks up
    every group (the storage view), so a block counts only when every worker can load
    its heads: block 3's second unit gone, the hit is blocks 0-2, loaded with no
    failure, not the six blocks whose first unit is stored."""
    with engine(model_dir, store, head_groups=2) as first:
        computed = first.generate({"a": PROMPT_A})["a"]
        store.evict(unit_hashes(first.lookups.chain(PROMPT_A)[3:4], 1, 1))
    with engine(model_dir, store, head_groups=2) as second:
        out = second.generate({"a": PROMPT_A})
        assert second.metrics()["load_failed_blocks"] == 0
    assert out["a"].num_cached_tokens == 3 * BLOCK and out["a"].tokens == computed.tokens


def test_a_tp2_engines_hit_needs_every_ranks_head_group(model_dir, store):
    """A TP=2 engine's scheduler (the connector's, as vLLM builds it) looks up the
    storage view of every head group, not its rank 0's: of a TP=1 engine's pages with
    block 3's second unit gone, it claims blocks 0-2, which both workers can load, not
    the six whose first unit (rank 0's head) is stored."""
    with engine(model_dir, store, head_groups=2) as first:
        first.generate({"a": PROMPT_A})
        store.evict(unit_hashes(first.lookups.chain(PROMPT_A)[3:4], 1, 1))
    args = engine_args(
        model_dir,
        None,
        None,
        role="kv_both",
        extra={"head_groups": 2},
        max_batched=2048,
        events_endpoint=None,
    )
    config = dataclasses.replace(args, tensor_parallel_size=2).create_engine_config()
    layers = attention_config([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], 64)
    scheduler = KVStoreConnector(config, KVConnectorRole.SCHEDULER, layers, stores=store.client)
    hit, _ = scheduler.get_num_new_matched_tokens(vllm_request("a", PROMPT_A), 0)
    assert hit == 3 * BLOCK and store.opened[-1].heads.count == 2  # both units asked for
    scheduler.shutdown()


def test_a_prompt_nothing_stored_begins_is_a_miss(model_dir, store):
    with engine(model_dir, store) as first:
        first.generate({"a": PROMPT_A})
    with engine(model_dir, store) as second:
        out = second.generate({"c": PROMPT_C})
        assert out["c"].num_cached_tokens == 0
        # looked up: the prompt's full blocks before its last token
        assert second.lookups.finds == [((len(PROMPT_C) - 1) // BLOCK, False)]
        assert second.metrics()["lookups"] == 1


def test_another_cache_salt_shares_nothing(model_dir, store):
    with engine(model_dir, store) as first:
        first.add("a", PROMPT_A, cache_salt="alice")
        first.run()
    with engine(model_dir, store) as second:
        second.add("bob", PROMPT_A, cache_salt="bob")
        second.add("plain", PROMPT_A)
        second.add("alice", PROMPT_A, cache_salt="alice")
        out = second.run()
    assert out["bob"].num_cached_tokens == 0
    assert out["plain"].num_cached_tokens == 0
    assert out["alice"].num_cached_tokens == A_HIT


def test_a_store_that_cannot_answer_within_the_lookup_budget_is_a_miss(model_dir, store):
    with engine(model_dir, store) as first:
        first.generate({"a": PROMPT_A})
    with engine(model_dir, store, lookup_budget_ms=10) as slow:
        slow.lookups.latency = 0.05  # answers in 50 ms: past the 10 ms budget
        assert slow.generate({"a": PROMPT_A})["a"].num_cached_tokens == 0
        assert slow.metrics()["lookup_faults"] == 1
    with engine(model_dir, store, lookup_budget_ms=100) as patient:
        patient.lookups.latency = 0.05  # within a 100 ms budget: a hit
        assert patient.generate({"a": PROMPT_A})["a"].num_cached_tokens == A_HIT
    with engine(model_dir, store) as down:
        down.lookups.down = True
        assert down.generate({"a": PROMPT_A})["a"].num_cached_tokens == 0


def test_an_announced_prefix_is_claimed_without_a_lookup(model_dir, store):
    """A P/D decode: the prefill's params claim its blocks at once, ``(n, True)``, and
    no lookup is made (``client.vllm.claims``)."""
    with engine(model_dir, store) as prefill:
        computed = prefill.generate({"a": PROMPT_A})["a"]
    params = announcement(BLOCK, PROMPT_A, NO_EXTRAS, len(PROMPT_A) // BLOCK)
    with engine(model_dir, store) as decode:
        looked_up = decode.lookups
        decode.add("a", PROMPT_A, **params)
        decode.step()
        request = decode.scheduler.requests["a"]
        assert request.num_computed_tokens == A_HIT  # claimed: at most the usable blocks
        assert looked_up.finds == []
        decode.run()
        assert decode.finished["a"].num_cached_tokens == A_HIT
        assert decode.finished["a"].tokens == computed.tokens
        assert looked_up.finds == []
        assert decode.metrics()["remote_prefills_announced"] == 1


# ---- the scheduler side alone: features vLLM's harness engine does not have -------------


def scheduler_over(store: MemoryStore, features: SchedulerFeatures, main) -> ConnectorScheduler:
    conf, _ = connector_options({"redis_url": "redis://in-memory.invalid:6379/0"})
    return ConnectorScheduler(conf, main, BLOCK, stats=StatsRecorder(), features=features)


def small_namespace(**kw) -> Namespace:
    base = dict(
        model="decisions",
        dtype="float32",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        block_size=BLOCK,
    )
    return Namespace(**{**base, **kw})


def vllm_request(req_id: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=1), None)


def test_a_hybrid_hit_ends_at_the_last_boundary_state_stored(store):
    """A state-space hybrid loads no further than its last stored boundary state
    (``client.vllm.states``): attention pages of 6 blocks, states at boundaries 2 and 4
    (blocks 1 and 3), so the hit is 4 blocks; with no state within it, a miss."""
    pages, states = store.client(small_namespace()), store.client(small_namespace(model="s"))
    page = bytes(2 * 2 * BLOCK * 2 * 32 * 4)
    pages.put(PROMPT_A, [page] * (len(PROMPT_A) // BLOCK))
    facts = StateFacts((0,), (1,), ("m",), ("a",), 64, False, "align", BLOCK)
    scheduler = scheduler_over(
        store, SchedulerFeatures(hybrid=True, states=facts, state_store=states), pages
    )
    assert scheduler.get_num_new_matched_tokens(vllm_request("none", PROMPT_A), 0) == (0, False)
    for boundary in (2, 4):
        states.put(PROMPT_A[: boundary * BLOCK], [b"s" * 64], start_block=boundary - 1)
    assert scheduler.get_num_new_matched_tokens(vllm_request("a", PROMPT_A), 0) == (
        4 * BLOCK,
        True,
    )
    assert states.finds[-1] == (A_HIT // BLOCK, True)  # asked within the attention prefix


def test_a_draft_hit_is_the_shorter_prefix_less_the_dropped_blocks(store):
    """A speculative draft's pages (``client.vllm.drafts``): the target holds 6 blocks,
    the draft 5, and EAGLE drops one: 4 blocks."""
    target, draft = store.client(small_namespace()), store.client(small_namespace(model="d"))
    page = bytes(16)
    target.put(PROMPT_A, [page] * 6)
    draft.put(PROMPT_A, [page] * 5)
    scheduler = scheduler_over(store, SchedulerFeatures(draft=draft, draft_drop=1), target)
    assert scheduler.get_num_new_matched_tokens(vllm_request("a", PROMPT_A), 0) == (
        4 * BLOCK,
        True,
    )


# ---- pins of what a request saves (kv_transfer_params kvstore_pin) ----------------------


def test_a_pin_is_handed_over_with_the_prompts_last_save_never_before(model_dir, store):
    """A chunked prefill (2 blocks a step) saves its blocks step by step; its pin of the
    first 4 blocks (``tokens`` 133: the 5th block is not whole) comes once, in the step
    its prompt completes, after every block is stored, under the request's identity."""
    asked = {"tokens": SHARED * BLOCK + 5, "ttl_s": 600}
    full = len(PROMPT_A) // BLOCK
    seen = []  # after each step: pages stored, pins made
    with ConnectorHarness(model_dir, None, store=store, max_batched=2 * BLOCK) as first:
        first.add("sys", PROMPT_A, cache_salt="team-a", kvstore_pin=asked)
        while first.scheduler.has_requests():
            first.step()
            seen.append((len(store), len(store.pins)))
        lookups = first.lookups
    pinned_at = next(i for i, (_, pins) in enumerate(seen) if pins)
    assert [stored for stored, _ in seen[:pinned_at]] == [2, 4, 6][:pinned_at]
    assert seen[pinned_at][0] == full and pinned_at >= 2  # not before the last chunk
    (pin,) = store.pins
    assert pin.ttl_s == 600 and all(pin.held)
    salted = lookups.chain(PROMPT_A, RequestIdentity(cache_salt="team-a"))
    assert pin.hashes == salted[:SHARED] != lookups.chain(PROMPT_A)[:SHARED]


def test_a_prompt_the_store_held_already_is_pinned_again(model_dir, store):
    """A second request of the same (system) prompt loads it and saves nothing new: its
    pin still goes out, renewing the first's TTL; one without the param pins nothing."""
    with engine(model_dir, store) as first:
        first.generate({"a": PROMPT_A})
    assert store.pins == []
    with engine(model_dir, store) as second:
        second.add("again", PROMPT_A, kvstore_pin={"ttl_s": 30})
        assert second.run()["again"].num_cached_tokens == A_HIT
    (pin,) = store.pins
    assert len(pin.hashes) == len(PROMPT_A) // BLOCK and all(pin.held) and pin.ttl_s == 30


def test_a_pin_of_a_request_that_saves_nothing_is_named_and_ignored(model_dir, store, caplog):
    caplog.set_level(logging.WARNING, logger="client.vllm")
    with engine(model_dir, store) as harness:
        harness.add("nosave", PROMPT_C, kvstore_save=False, kvstore_pin=True)
        harness.add("typo", PROMPT_A, kvstore_pin={"ttl": 60})
        out = harness.run()
    assert set(out) == {"nosave", "typo"}  # both ran
    assert store.pins == [] and len(store) == len(PROMPT_A) // BLOCK
    assert "nosave" in caplog.text and "kvstore_save is false" in caplog.text
    assert "typo" in caplog.text and "unknown key(s) ttl" in caplog.text
