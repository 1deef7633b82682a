"""The connector's logic in this process (tests/support/connector_harness.py): vLLM's own
scheduler and the connector's two halves over real storage nodes, with a stand-in model
whose output reads the KV cache, so wrong KV shows in the tokens and in ``check_cache``.
What needs a real engine (a model's KV, TP, PP, MLA, hybrid caches, drafts, the server)
is in the other ``test_vllm*`` files."""

from __future__ import annotations

import logging
import mmap
import os
import random
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from client import KVCacheClient
from client.memory.device_pages import HostCopier
from kvstore import Namespace, block_hashes
from kvstore.index import PageIndex
from kvstore.tools.launcher import LocalCluster
from tests.support.connector_harness import (
    BLOCK,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    PROMPT_D,
    SHARED,
    WEIGHTS,
    ConnectorHarness,
    write_config,
)
from tests.support.helpers import wait_for
from tests.support.vllm_runs import stored_pages

PAGE_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4


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


def first_token_step(steps: list[dict[str, int]], req_id: str) -> int:
    return next(i for i, counts in enumerate(steps) if counts.get(req_id, 0) >= 1)


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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("tiny-llama-config"))


@pytest.fixture(scope="module")
def baseline(model_dir) -> dict[str, list[int]]:
    """What each prompt generates with every lookup a miss (an index that is not there)."""
    with ConnectorHarness(model_dir, "redis://127.0.0.1:1/0", role="kv_consumer") as engine:
        out = engine.generate(dict(zip("ABCD", [PROMPT_A, PROMPT_B, PROMPT_C, PROMPT_D])))
    assert all(r.num_cached_tokens == 0 for r in out.values())
    return {name: r.tokens for name, r in out.items()}


@pytest.fixture()
def cluster():
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        yield cluster


def save(model_dir: str, cluster: LocalCluster, prompts: dict[str, list[int]], **kw) -> None:
    with ConnectorHarness(model_dir, cluster.redis_url, role="kv_producer", **kw) as producer:
        producer.generate(prompts)
    full = sum(len(p) // BLOCK for p in prompts.values())
    wait_for(lambda: stored_pages(cluster) >= full, 5, "the node to report its pages")


def test_a_hit_loads_the_stored_kv_exactly_and_generates_the_tokens_of_a_miss(
    model_dir, baseline, cluster
):
    save(model_dir, cluster, {"a": PROMPT_A})
    with ConnectorHarness(model_dir, cluster.redis_url, role="kv_consumer") as consumer:
        consumer.add("b", PROMPT_B)
        wrong = None
        while consumer.scheduler.has_requests():
            consumer.step()
            if wrong is None and consumer.steps[-1].get("b"):  # its prompt is in the cache
                wrong = consumer.check_cache("b", PROMPT_B, len(PROMPT_B))
        assert wrong == []  # loaded (4 blocks) and computed positions alike
        out = consumer.finished
        metrics = consumer.metrics()
    assert out["b"].num_cached_tokens == SHARED * BLOCK
    assert out["b"].tokens == baseline["B"]
    assert metrics["load_bytes"] == SHARED * PAGE_BYTES and metrics["load_failed_blocks"] == 0


def test_chunked_prefill_saves_the_whole_prompt(model_dir, baseline, cluster):
    # 64 tokens per step: prompt A's prefill takes four steps
    save(model_dir, cluster, {"a": PROMPT_A}, max_batched=64)
    assert stored_pages(cluster) == len(PROMPT_A) // BLOCK
    with ConnectorHarness(model_dir, cluster.redis_url, role="kv_consumer") as consumer:
        out = consumer.generate({"a": PROMPT_A})
    assert out["a"].num_cached_tokens == 6 * BLOCK and out["a"].tokens == baseline["A"]


def test_a_corrupted_page_is_recomputed_from_it_on(model_dir, baseline, cluster):
    save(model_dir, cluster, {"a": PROMPT_A})
    ns = PageIndex(cluster.redis_url).stats().namespaces[0].namespace
    corrupt_stored_page(cluster, ns, block_hashes(ns, PROMPT_A), 2, 16 << 20)
    with ConnectorHarness(model_dir, cluster.redis_url, role="kv_consumer") as consumer:
        consumer.add("b", PROMPT_B)
        wrong = None
        while consumer.scheduler.has_requests():
            consumer.step()
            if wrong is None and consumer.steps[-1].get("b"):
                wrong = consumer.check_cache("b", PROMPT_B, len(PROMPT_B))
        out, metrics = consumer.finished, consumer.metrics()
    assert wrong == [] and out["b"].tokens == baseline["B"]
    # block 2 failed its checksum: the load reports it and block 3 after it failed (two
    # pages loaded), and vLLM recomputes from it on; the lookup had found all four
    assert out["b"].num_cached_tokens == SHARED * BLOCK
    assert metrics["load_failed_blocks"] == 2 and metrics["load_bytes"] == 2 * PAGE_BYTES, metrics


def test_noise_under_the_right_keys_is_loaded_and_changes_the_tokens(model_dir, baseline, cluster):
    """The checks above are sensitive: pages of noise with valid checksums under B's
    block hashes are loaded, named wrong by check_cache, and change the output."""
    ns = Namespace(
        model=model_dir,
        dtype="float32",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        block_size=BLOCK,
        layout="vllm_cpu",
        weights=WEIGHTS,
    )  # what the connector keys the stand-in model by
    with KVCacheClient(cluster.redis_url, ns) as writer:
        noise = torch.randn((SHARED, *ns.page_shape), generator=torch.Generator().manual_seed(3))
        assert writer.put_pages(PROMPT_B[: SHARED * BLOCK], noise).stored == SHARED
    with ConnectorHarness(model_dir, cluster.redis_url, role="kv_consumer") as consumer:
        consumer.add("b", PROMPT_B)
        wrong: list[int] = []
        while consumer.scheduler.has_requests():
            consumer.step()
            if consumer.steps[-1].get("b") and not wrong:
                wrong = consumer.check_cache("b", PROMPT_B, SHARED * BLOCK)
        out = consumer.finished
    assert out["b"].num_cached_tokens == SHARED * BLOCK
    assert wrong == list(range(SHARED * BLOCK))
    assert out["b"].tokens != baseline["B"]


def test_two_loads_run_while_a_third_request_decodes(model_dir, baseline, cluster):
    """Loads are asynchronous: the scheduler keeps stepping a request that needs no load
    while two others wait for their blocks, and all three give the tokens of a miss."""
    save(model_dir, cluster, {"a": PROMPT_A, "c": PROMPT_C})
    with ConnectorHarness(model_dir, cluster.redis_url, role="kv_consumer") as consumer:
        out = consumer.generate({"d": PROMPT_D, "a": PROMPT_A, "c": PROMPT_C}, max_tokens=12)
        steps, metrics = consumer.steps, consumer.metrics()
    assert {k: r.tokens[:8] for k, r in out.items()} == {
        "d": baseline["D"],
        "a": baseline["A"],
        "c": baseline["C"],
    }
    assert [out[k].num_cached_tokens for k in "dac"] == [0, 6 * BLOCK, 7 * BLOCK]
    first = {k: first_token_step(steps, k) for k in "dac"}
    assert first["d"] < min(first["a"], first["c"]), steps
    for loaded in "ac":  # by the step a loaded request produced its first token, d had decoded
        assert steps[first[loaded]].get("d", 12) >= 2, steps
    assert metrics["load_failed_blocks"] == 0 and len(metrics["load_seconds"]) == 2, metrics
    assert metrics["load_bytes"] == 13 * PAGE_BYTES and metrics["lookup_hit_tokens"] == 13 * BLOCK


def test_a_hung_index_makes_misses_within_the_lookup_budget(model_dir, baseline):
    hole = Blackhole()
    # timeout: the sides' start-up calls wait on the hung index in steps of it (the
    # default 5 s made this test 10 s, 0.5 s makes it 3); lookups wait their own budget
    extra = {
        "lookup_budget_ms": 100,
        "breaker_failures": 2,
        "breaker_cooldown_s": 120,
        "timeout": 0.5,
    }
    try:
        url = f"redis://127.0.0.1:{hole.port}/0"
        with ConnectorHarness(model_dir, url, role="kv_consumer", extra=extra) as consumer:
            started = time.monotonic()
            out = consumer.generate(dict(zip("ABCD", [PROMPT_A, PROMPT_B, PROMPT_C, PROMPT_D])))
            seconds = time.monotonic() - started
            metrics = consumer.metrics()
    finally:
        hole.close()
    assert {k: r.tokens for k, r in out.items()} == baseline
    assert all(r.num_cached_tokens == 0 for r in out.values())
    # the first two lookups pass their budget, then the breaker answers without asking
    assert metrics["lookup_faults"] == 2 and metrics["lookups_skipped"] == 2, metrics
    assert len(metrics["lookup_seconds"]) == 2 and max(metrics["lookup_seconds"]) < 0.25, metrics
    assert seconds < 2.0


def test_a_salted_prompt_reads_only_the_pages_saved_under_its_salt(model_dir, cluster):
    """vLLM's cache_salt is part of a page's identity: the same tokens under another
    salt, or none, are a miss; under the same salt, a hit."""
    with ConnectorHarness(model_dir, cluster.redis_url, role="kv_producer") as producer:
        producer.add("a", PROMPT_A, cache_salt="alice")
        producer.run()
    wait_for(lambda: stored_pages(cluster) == 6, 5, "the node to report its pages")
    with ConnectorHarness(model_dir, cluster.redis_url, role="kv_consumer") as consumer:
        consumer.add("bob", PROMPT_A, cache_salt="bob")
        consumer.add("none", PROMPT_A)
        consumer.add("alice", PROMPT_A, cache_salt="alice")
        out = consumer.run()
    assert {k: r.num_cached_tokens for k, r in out.items()} == {
        "bob": 0,
        "none": 0,
        "alice": 6 * BLOCK,
    }
    assert out["alice"].tokens == out["none"].tokens == out["bob"].tokens


@pytest.mark.parametrize("device", ["host", "none"])
def test_a_layerwise_hit_loads_in_the_step_that_computes_the_rest(
    model_dir, baseline, cluster, device
):
    """With layer-wise loads the scheduler schedules a hit at once (a sync load): its
    pages land during that step's forward, layer by layer, where a device copier lands
    them (the host as the device here), or whole before the forward where none does; the
    first token comes from that first step, and the KV and tokens are a miss's."""
    save(model_dir, cluster, {"a": PROMPT_A})
    copier = HostCopier if device == "host" else lambda stats: None
    extra = {"layerwise_loads": "on"}
    with ConnectorHarness(
        model_dir, cluster.redis_url, role="kv_consumer", extra=extra, device=copier
    ) as consumer:
        consumer.add("b", PROMPT_B)
        consumer.step()
        assert consumer.steps[0] == {"b": 1}  # loaded and computed in one step
        assert consumer.check_cache("b", PROMPT_B, len(PROMPT_B)) == []
        out, metrics = consumer.run(), consumer.metrics()
    assert out["b"].num_cached_tokens == SHARED * BLOCK and out["b"].tokens == baseline["B"]
    assert metrics["load_bytes"] == SHARED * PAGE_BYTES and metrics["load_failed_blocks"] == 0
    assert metrics.get("device_loads", 0) == (1 if device == "host" else 0), metrics


@pytest.mark.parametrize("waits", [True, False], ids=["corrupted", "no-layer-waits"])
def test_a_layerwise_load_recomputes_what_it_could_not_feed(model_dir, baseline, cluster, waits):
    """A layer-wise load whose page fails its check (corrupted in the node's memory), or
    whose forward never waited for its layers, reports those blocks failed in the same
    step; vLLM drops that step's token and recomputes them, so the output is a miss's."""
    save(model_dir, cluster, {"a": PROMPT_A})
    if waits:
        ns = PageIndex(cluster.redis_url).stats().namespaces[0].namespace
        corrupt_stored_page(cluster, ns, block_hashes(ns, PROMPT_A), 2, 16 << 20)
    with ConnectorHarness(
        model_dir,
        cluster.redis_url,
        role="kv_consumer",
        extra={"layerwise_loads": "on"},
        device=HostCopier,
        layer_waits=waits,
    ) as consumer:
        consumer.add("b", PROMPT_B)
        consumer.step()
        assert consumer.steps[0] == {}  # the step's token was dropped
        out, metrics = consumer.run(), consumer.metrics()
    assert out["b"].tokens == baseline["B"]
    failed = 2 if waits else SHARED
    assert metrics["load_failed_blocks"] == failed, metrics
    assert metrics["load_bytes"] == (SHARED - failed) * PAGE_BYTES, metrics


def test_every_save_that_does_not_reach_the_store_is_counted(model_dir, cluster):
    """Saves that reach no node (the nodes stopped gracefully, the index up) and saves
    with the index gone are each counted as a failure, with nothing counted as sent,
    and the worker's log says so at most once a minute (the repeats at DEBUG)."""
    with ConnectorHarness(model_dir, cluster.redis_url, role="kv_producer") as producer:
        for node in cluster.nodes:
            node.kill(signal.SIGTERM)  # deregisters: the index lists no live node
        for node in cluster.nodes:
            node.process.wait(10)
        wait_for(lambda: not PageIndex(cluster.redis_url).live_nodes(), 10, "no live node")
        producer.generate({"a": PROMPT_A, "c": PROMPT_C}, max_tokens=2)
        wait_for(lambda: producer.metrics().get("save_failures", 0) >= 2, 10, "two failures")
        assert not producer.metrics().get("save_bytes")
        cluster.valkey.stop()  # and now the index too
        producer.generate({"d": PROMPT_D}, max_tokens=2)
        wait_for(lambda: producer.metrics().get("save_failures", 0) >= 3, 30, "a third failure")
    metrics = producer.metrics()
    assert metrics["save_failures"] == 3 and not metrics.get("save_bytes"), metrics


def test_start_lines_warn_when_the_store_is_unusable_and_name_one_namespace(model_dir, cluster):
    """Each side's start line is INFO when the index and a node answer, a WARNING when
    the index is unreachable (the engine runs without the store), and both sides name
    the one namespace id the index lists. A misspelt key is refused naming the option
    it is closest to, and its kind."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("client.vllm.options")  # kvstore's loggers do not propagate
    logger.addHandler(handler)  # once the connector adopted vLLM's handlers
    save(model_dir, cluster, {"a": PROMPT_A})  # the index lists namespaces holding pages
    records.clear()
    try:
        with ConnectorHarness(model_dir, cluster.redis_url):
            pass
        good = [r for r in records if "KVStoreConnector (" in r.getMessage()]
        records.clear()
        with ConnectorHarness(model_dir, "redis://127.0.0.1:1/0"):
            pass
        bad = [r for r in records if "KVStoreConnector (" in r.getMessage()]
    finally:
        logger.removeHandler(handler)
    assert len(good) == len(bad) == 2  # the scheduler's and the worker's (kv_both)
    assert {r.levelname for r in good} == {"INFO"} and {r.levelname for r in bad} == {"WARNING"}
    assert all("NOT reached" in r.getMessage() for r in bad)
    ids = {re.search(r"namespace ([0-9a-f]{32})", r.getMessage())[1] for r in good + bad}
    listed = {n.namespace.digest_hex for n in PageIndex(cluster.redis_url).stats().namespaces}
    assert len(ids) == 1 and ids <= listed, (ids, listed)
    with pytest.raises(ValueError, match="did you mean the connector option lookup_budget_ms"):
        ConnectorHarness(model_dir, cluster.redis_url, extra={"lookup_budget_msec": 100})
