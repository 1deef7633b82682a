"""Faults as a client sees them: a cancelled blocking call, bad or unknown options, an
index script error (a bug, not an outage), a stopped index shard, and a lost node's
lines in the client's output."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import redis
import torch

from client import AsyncKVCacheClient, KVCacheClient
from kvstore import (
    InvalidInputError,
    Namespace,
    TransportError,
    block_hashes,
    part_hashes,
    sequence_hash,
)
from kvstore.index import PageIndex
from kvstore.pages import keys
from kvstore.settings.client import client_options
from kvstore.tools.launcher import LocalCluster
from tests.support.helpers import (
    ROOT,
    kv_for,
    metrics,
    namespace_for_page_size,
    no_tracebacks,
    pages_for,
    run_worker,
    spec,
)

pytestmark = pytest.mark.faults  # kills, stalls, corrupt frames: part of `pytest -m faults`


def test_a_cancelled_blocking_call_returns_only_after_it_unwound(clusters):
    cluster = clusters()
    ns = namespace_for_page_size(64 << 10, tenant="unwind")
    marks: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.3)  # unwinding (closing endpoints) takes time
            marks.append("unwound")

    with KVCacheClient(cluster.redis_url, ns) as client:
        with pytest.raises(TransportError, match="did not finish"):
            client._run(slow(), timeout=0.2)
        assert marks == ["unwound"]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_bad_client_options_are_refused_naming_the_option(bad, monkeypatch):
    ns = namespace_for_page_size(64 << 10, tenant="options")
    with pytest.raises(InvalidInputError, match="timeout"):
        AsyncKVCacheClient("redis://127.0.0.1:1/0", ns, timeout=bad)
    with pytest.raises(InvalidInputError, match="timeout"):
        client_options(timeout=bad)  # the vLLM connector's extra config goes through this
    monkeypatch.setenv("KVSTORE_TIMEOUT", str(bad))
    with pytest.raises(InvalidInputError, match="KVSTORE_TIMEOUT"):
        KVCacheClient.from_env(ns)


def test_unknown_client_options_are_refused():
    ns = namespace_for_page_size(64 << 10, tenant="options")
    with pytest.raises(InvalidInputError, match="timout"):
        AsyncKVCacheClient("redis://127.0.0.1:1/0", ns, timout=3)
    with pytest.raises(InvalidInputError, match="replicas"):
        client_options(replicas=0)


def test_a_script_error_is_a_bug_logged_at_error_not_an_unavailable_index(clusters, caplog):
    cluster = clusters()
    ns = namespace_for_page_size(64 << 10, tenant="script-error")
    tokens = list(range(4 * ns.block_size))
    raw = redis.Redis.from_url(cluster.redis_url)
    with KVCacheClient(cluster.redis_url, ns) as client:
        client.put_pages(tokens, pages_for(ns, tokens))
        segment = keys.segment_key(ns.key.prefix, block_hashes(ns, tokens)[0])
        raw.delete(segment)
        raw.hset(segment, "not", "a string")  # every script that reads it now fails
        out = torch.empty(4, *ns.page_shape, dtype=torch.float16)
        with caplog.at_level(logging.ERROR):
            assert client.get_pages(tokens, out) == 0
        assert client.stats.index_script_errors == 1 and client.stats.index_errors == 0
        assert any(
            r.levelno == logging.ERROR and "rejected" in r.getMessage() for r in caplog.records
        )
        with pytest.raises(InvalidInputError):  # usage errors still propagate
            client.get_pages(tokens, out.to(torch.float32))
        # a new page in the broken segment: the node's commit is refused, it stores nothing
        more = tokens[: ns.block_size] + list(range(10_000, 10_000 + ns.block_size))
        report = client.put_pages(more, pages_for(ns, more))
        assert report.sent == 0 and report.stored == 1  # only the block it already held
    assert metrics(cluster, "node-0")['kvstore_errors_total{kind="index_script"}'] >= 1


@pytest.mark.process
def test_a_stopped_index_shard_shortens_prefixes_for_every_client():
    """Two storage nodes on a 3-shard index cluster; two clients (this process and a
    worker process) publish prompts long enough that their segments live on every shard,
    then select them; one shard stops in the middle: every select returns a shorter
    prefix, bit-exact, without an exception and within the timeout."""
    ns = Namespace(
        model="shard-fault",
        dtype="float16",
        num_layers=1,
        num_kv_heads=1,
        head_size=32,
        block_size=4,
    )
    per_segment = keys.SEGMENT_PAGES * ns.block_size
    first = list(range(12 * per_segment + 2))  # 12 segments and a tail part
    second = first[: 5 * per_segment] + list(range(500_000, 500_000 + 7 * per_segment + 3))
    with LocalCluster(servers=2, capacity="64MiB", slab_size="4MiB", index_shards=3) as cluster:
        with KVCacheClient(cluster.redis_url, ns, timeout=3) as mine:
            writer = run_worker(spec(cluster, ns, "insert", tokens=first, hidden=False))
            assert writer["report"]["stored"] == 12 * keys.SEGMENT_PAGES + 1
            assert insert_tokens(mine, ns, second).stored == 12 * keys.SEGMENT_PAGES + 1
            for tokens in (first, second):
                got = run_worker(spec(cluster, ns, "select", tokens=tokens))
                assert got["matched"] == len(tokens) and got["exact"]
            index = PageIndex(cluster.redis_url)
            index.ping()
            topology = index._router.topology
            shard_of = lambda tokens: [
                topology.shard_of(keys.segment_key(ns.key.prefix, block_hashes(ns, tokens)[s]))
                for s, _ in keys.segments(len(tokens) // ns.block_size)
            ]
            registry = topology.shard_of(keys.NODES_ZSET)
            victim = next(s for s in range(3) if s not in (registry, shard_of(first)[0]))
            cluster.valkey.shards[victim].stop()
            for tokens in (first, second):
                expected = (
                    shard_of(tokens).index(victim) * per_segment
                    if victim in shard_of(tokens)
                    else len(tokens)
                )
                start = time.monotonic()
                got = run_worker(
                    spec(cluster, ns, "select", tokens=tokens, options={"timeout": 3})
                )  # a new process: seeds, one dead
                assert got["matched"] == expected and got["exact"] and expected < len(tokens)
                key, value, _ = kv_for(ns, tokens)
                _, roi, k, v, h = mine.select(
                    torch.tensor(tokens), torch.ones(len(tokens), dtype=torch.bool)
                )
                assert roi is not None and int(roi.sum()) == expected and h is None, (
                    mine.stats,
                    expected,
                    shard_of(tokens),
                    victim,
                )
                assert torch.equal(
                    k.view(torch.uint8), key[:, :expected].contiguous().view(torch.uint8)
                )
                assert time.monotonic() - start < 60
            assert mine.stats.index_errors >= 2
            # writes go on: pages whose segments live on the stopped shard are not stored
            third = list(range(900_000, 900_000 + 3 * per_segment))
            report = insert_tokens(mine, ns, third)
            lost = shard_of(third).count(victim) * keys.SEGMENT_PAGES
            tail = keys.segment_key(ns.key.prefix, part_hashes(sequence_hash(ns, third), 1)[0])
            lost += topology.shard_of(tail) == victim
            assert report.stored == 3 * keys.SEGMENT_PAGES + 1 - lost
        no_tracebacks(cluster)


def insert_tokens(client, ns, tokens):
    key, value, _ = kv_for(ns, tokens)
    return client.insert(
        torch.tensor(tokens), torch.ones(len(tokens), dtype=torch.bool), key, value
    )


LOSING_CLIENT = """
import sys, time, torch
from client import KVCacheClient
from kvstore import Namespace
ns = Namespace(model="ucxx-log", dtype="float16", num_layers=2, num_kv_heads=2, head_size=32, block_size=16)
with KVCacheClient(sys.argv[1], ns, timeout=2, same_host=False) as c:
    tokens, pages = list(range(64)), torch.ones((4, *ns.page_shape), dtype=torch.float16)
    c.put_pages(tokens, pages)
    print("ready", flush=True)
    end = time.time() + 5
    while time.time() < end:
        c.get_pages(tokens, torch.zeros_like(pages)); c.put_pages(tokens, pages); time.sleep(0.05)
print("done", flush=True)
"""


@pytest.mark.process
def test_a_lost_node_leaves_no_raw_ucxx_lines_in_the_clients_output(tmp_path):
    """A client (an engine's, say) whose node was killed under its UCX gets and puts
    says so in its own words, rate-limited; ucxx's own ERROR lines about the lost
    endpoints ("Endpoint is not connected") stay out of the process's output (they did,
    three in five seconds, before ``UCXX_LOG_LEVEL`` defaulted to FATAL)."""
    script = tmp_path / "losing_client.py"
    script.write_text(LOSING_CLIENT)
    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB") as cluster:
        proc = subprocess.Popen(
            [sys.executable, str(script), cluster.redis_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        cluster.nodes[0].kill()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip().endswith("done"), out[-2000:]
    assert "node node-0 failed" in out and out.count("node node-0 failed") == 1, out[-2000:]
    assert not [line for line in out.splitlines() if "UCXX ERROR" in line], out[-2000:]


STARTING_CLIENT = """
import asyncio, sys, torch
from client import AsyncKVCacheClient, KVCacheClient
from kvstore import Namespace
ns = Namespace(model="warnings", dtype="float16", num_layers=2, num_kv_heads=2, head_size=32, block_size=16)
tokens, pages = list(range(64)), torch.ones((4, *ns.page_shape), dtype=torch.float16)
with KVCacheClient(sys.argv[1], ns, timeout=2) as c:
    c.put_pages(tokens, pages)
    assert c.lookup(tokens) == 64 and c.get_pages(tokens, torch.zeros_like(pages)) == 64
async def main():
    async with AsyncKVCacheClient(sys.argv[1], ns, timeout=2) as a:
        assert await a.lookup(tokens) == 64
asyncio.run(main())
print("done", flush=True)
"""


@pytest.mark.process
def test_a_client_start_raises_no_userwarning(tmp_path):
    """A client's start, put, lookup and get, sync and asyncio, with UserWarnings made
    errors: redis-py 8.2 warned at every asyncio client built with a synchronous Retry
    (kvstore.index.routing), in every node log and twice per vLLM start."""
    script = tmp_path / "starting_client.py"
    script.write_text(STARTING_CLIENT)
    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB") as cluster:
        out = subprocess.run(
            [sys.executable, "-W", "error::UserWarning", str(script), cluster.redis_url],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-3000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.process
def test_a_save_after_the_store_restarted_logs_no_refusal_and_counts_no_failure(caplog):
    """`kvstore down` and `up`: an empty index and fresh nodes under an engine that stayed
    up. Its next save is refused for an unknown namespace, registers it again and is
    stored: said at INFO, with no WARNING and no page counted refused (it logged "put
    refused ... not registered" at WARNING although nothing was lost)."""
    ns = namespace_for_page_size(64 << 10, tenant="store-restart")
    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB") as cluster:
        client = KVCacheClient(cluster.redis_url, ns, timeout=2, same_host=False)
        try:
            first = list(range(4 * ns.block_size))
            assert client.put_pages(first, pages_for(ns, first)).stored == 4
            node = cluster.nodes[0]
            node.kill()
            node.process.wait(10)
            cluster.valkey.restart(keep_data=False)
            cluster.add_node(node.node_id)
            cluster.wait_registered()
            time.sleep(2.5)  # the client's directory reads the registry (node_refresh)
            caplog.clear()
            with caplog.at_level(logging.INFO):
                later = list(range(10_000, 10_000 + 4 * ns.block_size))
                report = client.put_pages(later, pages_for(ns, later))
            assert report.stored == 4 and client.stats.pages_refused == 0, report
            assert _warnings(caplog) == []
            assert any("registering it again" in r.getMessage() for r in caplog.records)
            assert client.lookup(later) == len(later)
        finally:
            client.close()


@pytest.mark.process
def test_a_lookup_past_its_time_limit_is_not_called_unreachable(caplog):
    """An index that is alive but slow (stopped for 0.4 s here; a loaded machine in the
    field) answers a lookup after its 50 ms budget: a miss, counted as a timeout, logged
    as such, never as "unreachable"."""
    ns = namespace_for_page_size(64 << 10, tenant="slow-index")
    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB") as cluster:
        with KVCacheClient(cluster.redis_url, ns, timeout=2, same_host=False) as client:
            tokens = list(range(4 * ns.block_size))
            client.put_pages(tokens, pages_for(ns, tokens))
            assert client.find(tokens, timeout=0.05) is not None
            valkey = cluster.valkey.process
            valkey.send_signal(signal.SIGSTOP)
            try:
                with caplog.at_level(logging.INFO):
                    started = time.monotonic()
                    assert client.find(tokens, timeout=0.05) is None
                    took = time.monotonic() - started
            finally:
                valkey.send_signal(signal.SIGCONT)
            assert took < 0.5  # one retry of the budget, not the client's 2 s timeout
            assert client.stats.index_timeouts == 1 and client.stats.index_errors == 1
            said = " ".join(_warnings(caplog))
            assert "past its time limit" in said and "unreachable" not in said, said
            assert client.find(tokens, timeout=0.5) is not None
