"""A saturated host: the storage node, its client and four busy loops on this 2-core
VM (three runnable processes per core): the node stays alive and listed, and every page just stored is found and
fetched, bit-exact, however slowly; a lookup past its budget is a miss the client
counts as such (``index_timeouts``), never a node counted as gone.

bench/saturation.py gives the figures (hits and lookup p99 with 0, 2 and 4 hogs, and
under memory pressure); tests/faults/test_faults_memory.py the OOM killer's pick."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from client import KVCacheClient
from kvstore.errors import KVStoreError
from kvstore.tools.launcher import LocalCluster
from kvstore.tools.programs import Program
from tests.support.helpers import namespace_for_page_size, pages_for
from tests.support.worker import same_bytes

pytestmark = [pytest.mark.faults, pytest.mark.process]


@pytest.fixture()
def hogs():
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_starved_node_still_serves_every_page_just_stored(clusters, hogs):
    """(At nice 19 beside these hogs a node took over 30 s to start, and `kvstore up`
    gave up on it: slow, not dead; the launcher's timeout message says which.)"""
    ns = namespace_for_page_size(1 << 16, tenant="starved")
    cluster = clusters(capacity="128MiB", slab="4MiB")
    with KVCacheClient(cluster.redis_url, ns) as client:
        for k in range(8):
            tokens = list(range(k * 100_000, k * 100_000 + 32 * ns.block_size))
            pages = pages_for(ns, tokens)
            assert client.put_pages(tokens, pages).stored == 32
            out = torch.empty_like(pages)
            assert client.get_pages(tokens, out) == len(tokens)  # every page, at once
            assert same_bytes(out, pages)
        # an index that answers late (stopped for the call): a miss named as over budget
        cluster.valkey.process.send_signal(signal.SIGSTOP)
        try:
            assert client.lookup_checked(tokens, timeout=0.05) is None
        finally:
            cluster.valkey.process.send_signal(signal.SIGCONT)
        stats = client.stats
        assert stats.index_timeouts == 1
        assert stats.node_errors == stats.node_timeouts == stats.nodes_left == 0
        assert cluster.nodes[0].process.poll() is None


class NeverRegisters(Program):
    """A node that is alive but never registers: one too slow to start."""

    def argv(self, *args: str) -> list[str]:
        return ["sh", "-c", "echo faulting in page memory; exec sleep 60"]


def test_a_node_too_slow_to_start_is_named_as_slow_not_dead():
    """`kvstore up` under saturation once said only "did not register within 30 s": the
    message now says which node, that it is still running, its last line and the load."""
    cluster = LocalCluster(1, "64MiB", node_program=NeverRegisters("-", "a slow node"))
    with pytest.raises(KVStoreError) as err:
        cluster.start(timeout=2)
    cluster.stop()
    message = str(err.value)
    assert "node-0 still starting, its last log line: faulting in page memory" in message
    assert "load average" in message
