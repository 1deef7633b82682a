"""The client and the nodes it sees: nodes joining, leaving and killed, a registry read
in the background or failing, the index gone, options from the environment, refused
tokens."""

from __future__ import annotations

import time

import pytest
import torch

from client import KVCacheClient
from client.nodes.placement import place
from kvstore import block_hashes
from kvstore.errors import CredentialError
from kvstore.index import PageIndex
from kvstore.pages import keys
from kvstore.tools.launcher import LocalCluster
from tests.support.client_fixtures import BLOCK, client, cluster, insert, make_ns, ns, same, select  # noqa: F401 (fixtures)
from tests.support.helpers import pages_for


@pytest.mark.process
def test_nodes_joining_are_picked_up_without_restarting_clients():
    ns = make_ns("joining")
    with (
        LocalCluster(servers=1, capacity="128MiB", slab_size="16MiB") as c,
        KVCacheClient(c.redis_url, ns) as cl,
    ):
        cl.put_pages(list(range(20 * BLOCK)), pages_for(ns, list(range(20 * BLOCK))))
        c.add_node("node-late")
        c.wait_registered()
        time.sleep(1.2)  # the client re-reads the registry every second
        tokens = list(range(100_000, 100_000 + 40 * BLOCK))
        assert cl.put_pages(tokens, pages_for(ns, tokens)).stored == 40
        index = PageIndex(c.redis_url)
        result = index.lookup(ns, block_hashes(ns, tokens), lease_ms=0).resolve(index.live_nodes())
        holders = {loc.node_id for locs in result.locations for loc in locs}
        assert holders == {"node-0", "node-late"}


def _written_to(c: LocalCluster, ns, tokens: list[int]) -> set[str]:
    """Store ``tokens``' pages through a new client; the nodes that hold them, as a
    fresh index read shows."""
    with KVCacheClient(c.redis_url, ns) as writer:
        assert writer.put_pages(tokens, pages_for(ns, tokens)).stored == len(tokens) // BLOCK
    index = PageIndex(c.redis_url)
    result = index.lookup(ns, block_hashes(ns, tokens), lease_ms=0).resolve(index.live_nodes())
    index.close()
    return {loc.node_id for locs in result.locations for loc in locs}


@pytest.mark.process
def test_a_lookup_uses_the_node_list_read_in_the_background():
    """A client in use reads the registry in the background every ``node_refresh``
    seconds, so a node that joined counts without any lookup reading the registry in
    its own round trip (``fresh`` hands calls the list), and its pages on the new node
    are found and fetched."""
    ns = make_ns("stale-list")
    tokens = list(range(40 * BLOCK))
    with LocalCluster(servers=1, capacity="128MiB", slab_size="16MiB") as c:
        with KVCacheClient(c.redis_url, ns, node_refresh=0.3) as reader:
            c.add_node("node-late")
            c.wait_registered()
            assert _written_to(c, ns, tokens) == {"node-0", "node-late"}
            directory = reader._async.nodes
            deadline = time.monotonic() + 5
            while {n.node_id for n in directory.cached() or []} != {"node-0", "node-late"}:
                assert time.monotonic() < deadline, "the background read never took node-late"
                time.sleep(0.01)
            assert directory.fresh() is not None  # a call takes this list: it reads nothing
            assert reader.find(tokens).tokens == 40 * BLOCK  # pages on node-late count
            out = torch.empty(40, *ns.page_shape, dtype=ns.torch_dtype())
            assert reader.get_pages(tokens, out) == 40 * BLOCK
            assert torch.equal(out.view(torch.uint8), pages_for(ns, tokens).view(torch.uint8))


@pytest.mark.process
def test_a_lookup_after_the_client_was_idle_reads_the_registry_in_its_own_round_trip(
    monkeypatch,
):
    """Idle longer than ``KEEP_FRESH_S``, a client stops reading the registry and its
    list goes stale; the next lookup in the caller's thread reads the registry in the
    same round trip as its segments (not through the client's loop and a read of its
    own: 2-4 ms after a pause, bench/lookup.py), so a node that joined meanwhile counts
    at once, and the client keeps the list it read."""
    import client.nodes.directory as directory_module

    monkeypatch.setattr(directory_module, "KEEP_FRESH_S", 0.5)
    ns = make_ns("idle-list")
    tokens = list(range(40 * BLOCK))
    with LocalCluster(servers=1, capacity="128MiB", slab_size="16MiB") as c:
        with KVCacheClient(c.redis_url, ns, node_refresh=0.2) as reader:
            assert reader.lookup(tokens) == 0  # registers the namespace; in use
            directory = reader._async.nodes
            deadline = time.monotonic() + 10
            while not directory._dormant:
                assert time.monotonic() < deadline, "the idle client kept reading the registry"
                time.sleep(0.05)
            c.add_node("node-late")
            c.wait_registered()
            assert "node-late" in _written_to(c, ns, tokens)
            deadline = time.monotonic() + 10
            while directory.cached() is not None:  # older than two refreshes now
                assert time.monotonic() < deadline
                time.sleep(0.05)
            through_loop = []
            on_loop = reader._async.find
            monkeypatch.setattr(
                reader._async, "find", lambda *a, **k: through_loop.append(a) or on_loop(*a, **k)
            )
            assert reader.find(tokens).tokens == 40 * BLOCK  # node-late's pages count
            assert through_loop == []
            assert {n.node_id for n in directory.cached() or []} == {"node-0", "node-late"}


def _tokens_off_registry(c: LocalCluster, ns) -> tuple[list[int], int]:
    """A prompt of 8 blocks (one segment) whose segment lies on another shard than the
    node registry, and the registry's shard number."""
    index = PageIndex(c.redis_url)
    index.ping()
    topology = index._router.topology
    index.close()
    registry = topology.shard_of(keys.NODES_ZSET)
    tokens = next(
        t
        for t in (list(range(k, k + 8 * BLOCK)) for k in range(10_000))
        if topology.shard_of(keys.segment_key(ns.storage.key.prefix, block_hashes(ns, t)[0]))
        != registry
    )
    return tokens, registry


@pytest.mark.process
@pytest.mark.parametrize("idle", [False, True], ids=["in-use", "idle"])
def test_a_stale_node_list_whose_registry_read_fails_keeps_the_last_list(idle, monkeypatch):
    """When the registry's shard is down but the lookup's segment is elsewhere, a lookup
    after the registry read failed still answers, from the last list it had, and counts
    the fault; nothing is raised. In use, the background read failed; idle (past
    ``KEEP_FRESH_S``), the lookup's own read in its round trip failed
    (``NodeDirectory.offered``), in the caller's thread."""
    import client.nodes.directory as directory_module

    monkeypatch.setattr(directory_module, "KEEP_FRESH_S", 0.5)
    ns = make_ns(f"stale-list-fault-{idle}")
    with LocalCluster(servers=1, capacity="128MiB", slab_size="16MiB", index_shards=3) as c:
        tokens, registry = _tokens_off_registry(c, ns)
        with KVCacheClient(c.redis_url, ns, node_refresh=0.2, timeout=1.0) as client:
            assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 8
            assert client.find(tokens).tokens == 8 * BLOCK
            directory = client._async.nodes
            deadline = time.monotonic() + 10
            if idle:
                while directory.cached() is not None:  # dormant, and its list stale
                    assert time.monotonic() < deadline, "the idle client's list stayed fresh"
                    time.sleep(0.05)
                c.valkey.shards[registry].stop()
                through_loop = []
                on_loop = client._async.find
                monkeypatch.setattr(
                    client._async,
                    "find",
                    lambda *a, **k: through_loop.append(a) or on_loop(*a, **k),
                )
            else:
                c.valkey.shards[registry].stop()
                while not directory._read_failed:  # the background read found the registry down
                    assert time.monotonic() < deadline, "the background read never failed"
                    client.find(tokens)  # keeps the client in use, so the reads go on
                    time.sleep(0.05)
            faults = client.stats.index_errors
            assert client.find(tokens).tokens == 8 * BLOCK  # the last list names the node
            assert client.stats.index_errors > faults  # deciding on the last list is counted
            assert directory._read_failed
            if idle:
                assert through_loop == []


@pytest.mark.process
def test_an_idle_async_client_reads_the_registry_in_its_lookup(monkeypatch):
    """``AsyncKVCacheClient.find`` after an idle spell (past ``KEEP_FRESH_S``) reads the
    registry in the lookup's round trip, so a node that joined meanwhile counts."""
    import asyncio

    import client.nodes.directory as directory_module
    from client import AsyncKVCacheClient

    monkeypatch.setattr(directory_module, "KEEP_FRESH_S", 0.5)
    ns = make_ns("idle-async")
    tokens = list(range(40 * BLOCK))

    async def scenario(c: LocalCluster) -> tuple[int, set[str]]:
        async with AsyncKVCacheClient(c.redis_url, ns, node_refresh=0.2) as reader:
            assert (await reader.find(tokens)).tokens == 0
            directory = reader.nodes
            while directory.cached() is not None:  # dormant, and its list stale
                await asyncio.sleep(0.05)
            await asyncio.to_thread(c.add_node, "node-late")
            await asyncio.to_thread(c.wait_registered)
            assert "node-late" in await asyncio.to_thread(_written_to, c, ns, tokens)
            found = await reader.find(tokens)
            return found.tokens, {n.node_id for n in directory.cached() or []}

    with LocalCluster(servers=1, capacity="128MiB", slab_size="16MiB") as c:
        matched, listed = asyncio.run(scenario(c))
    assert matched == 40 * BLOCK
    assert listed == {"node-0", "node-late"}


@pytest.mark.process
@pytest.mark.parametrize("replicas", [1, 2])
def test_one_of_two_nodes_killed(replicas):
    ns = make_ns(f"replicas-{replicas}")
    tokens = list(range(30 * BLOCK + 5))
    with LocalCluster(servers=2, capacity="128MiB", slab_size="16MiB") as c:
        with KVCacheClient(c.redis_url, ns, replicas=replicas, timeout=3) as cl:
            report, (key, value, hidden) = insert(cl, tokens)
            assert report.stored == 31 and report.sent == 31 * replicas
            c.nodes[1].kill()
            c.nodes[1].process.wait()
            start = time.monotonic()
            _, roi, k, v, h = select(cl, tokens)
            assert time.monotonic() - start < 10
            hashes = block_hashes(ns, tokens)
            if replicas == 2:
                assert int(roi.sum()) == len(tokens) and same(h, hidden)
            else:
                # the surviving prefix: blocks up to the first one placed on the dead node
                expect = next(
                    (
                        i
                        for i, hh in enumerate(hashes)
                        if place(hh, ["node-0", "node-1"], 1) != ["node-0"]
                    ),
                    len(hashes),
                )
                assert expect < len(hashes)  # this token list does put some blocks on node-1
                assert (0 if roi is None else int(roi.sum())) == expect * BLOCK
            if roi is not None:
                m = int(roi.sum())
                assert same(k, key[:, :m]) and same(v, value[:, :m])


@pytest.mark.process
def test_redis_gone_turns_into_a_miss_not_an_exception():
    ns = make_ns("redis-gone")
    tokens = list(range(3 * BLOCK))
    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB") as c:
        with KVCacheClient(c.redis_url, ns, timeout=2) as cl:
            insert(cl, tokens)
            c.valkey.stop()
            start = time.monotonic()
            assert select(cl, tokens) == [None] * 5
            assert cl.lookup(tokens) == 0
            assert time.monotonic() - start < 15
            assert cl.stats.index_errors >= 2
        # a client may even start while the index is down: it misses until it is back
        with KVCacheClient(c.redis_url, ns, timeout=2) as cl:
            assert cl.lookup(tokens) == 0
            c.valkey.start()
            c.wait_registered()
            insert(cl, tokens)
            assert cl.lookup(tokens) == 3 * BLOCK


def test_client_from_environment(cluster, ns, monkeypatch):
    monkeypatch.setenv("KVSTORE_REDIS_URL", cluster.redis_url)
    monkeypatch.setenv("KVSTORE_REPLICAS", "2")
    monkeypatch.setenv("KVSTORE_TIMEOUT", "3.5")
    monkeypatch.setenv("KVSTORE_TRANSFER_MODE", "staged")
    with KVCacheClient.from_env(ns) as cl:
        assert (
            cl._async.replicas == 2
            and cl._async.timeout == 3.5
            and cl._async.transfer_mode == "staged"
        )
        tokens = list(range(3 * BLOCK))
        report = cl.put_pages(tokens, pages_for(ns, tokens))
        assert report.stored == 3 and report.sent == 6  # two replicas each
    monkeypatch.setenv("KVSTORE_REPLICAS", "0")
    with pytest.raises(ValueError, match="replicas"):
        KVCacheClient.from_env(ns)


@pytest.mark.process
def test_data_plane_token_is_enforced():
    ns = make_ns("token")
    tokens = list(range(2 * BLOCK))
    """A wrong or missing token is a configuration error, raised (a PermissionError
    naming the node, the tenant and where a token comes from), not a silent miss, on
    both paths and by both APIs; the refusing node is not taken for a failed one."""
    key, value = (
        torch.randn(ns.num_layers, len(tokens), ns.num_kv_heads, ns.head_size).half()
        for _ in range(2)
    )
    roi = torch.ones(len(tokens), dtype=torch.bool)
    with LocalCluster(
        servers=1, capacity="64MiB", slab_size="16MiB", extra_args=["--auth-token", "s3cret"]
    ) as c:
        for same_host in (True, False):
            for token in ("wrong", ""):
                with KVCacheClient(
                    c.redis_url, ns, auth_token=token, timeout=3, same_host=same_host
                ) as intruder:
                    for _ in range(2):  # the second call asks the node again: it was not suspected
                        with pytest.raises(
                            CredentialError,
                            match="node-0: unauthorized.*tenant 'token'.*KVSTORE_AUTH_TOKEN",
                        ) as refused:
                            intruder.put_pages(tokens, pages_for(ns, tokens))
                        assert (
                            isinstance(refused.value, PermissionError)
                            and refused.value.node_ids == ["node-0"]
                            and refused.value.operation == "store"
                        )
                    with pytest.raises(PermissionError, match="refused to store"):
                        intruder.insert(tokens, roi, key, value)
                    assert (
                        intruder.stats.node_errors == 0 and intruder.stats.credential_refusals == 3
                    )
        with KVCacheClient(c.redis_url, ns, auth_token="s3cret") as cl:
            assert cl.put_pages(tokens, pages_for(ns, tokens)).stored == 2
            assert cl.insert(tokens, roi, key, value).stored == 3  # two blocks and the tail
        for same_host in (True, False):
            with KVCacheClient(
                c.redis_url, ns, auth_token="wrong", timeout=3, same_host=same_host
            ) as intruder:
                out = torch.zeros(2, *ns.page_shape, dtype=torch.float16)
                with pytest.raises(
                    PermissionError, match="refused to read pages of tenant 'token'"
                ):
                    intruder.get_pages(tokens, out)
                assert not out.any()
                with pytest.raises(PermissionError, match="refused to read"):
                    intruder.select(tokens, roi)


@pytest.mark.parametrize(
    "url",
    ["redis://kvstore-no-such-host.invalid:6379/0", "redis://127.0.0.1:1/0"],
    ids=["unresolvable", "refused"],
)
def test_an_index_that_cannot_be_reached_is_a_fault_not_a_shorter_prefix(url):
    """README once showed a Kubernetes Service name, pasted where it does not resolve:
    the lookup answered "0 stored" and nothing counted a fault, so the vLLM scheduler's
    breaker never opened. Nothing answered is a fault (None), counted."""
    with KVCacheClient(url, make_ns("unreachable"), timeout=1) as cl:
        tokens = list(range(3 * BLOCK))
        assert (
            cl.lookup_checked(tokens) is None and cl.find(tokens) is None and cl.lookup(tokens) == 0
        )
        assert cl.stats.index_errors >= 2


@pytest.mark.process
def test_start_status_names_the_nodes_that_refused_the_token():
    """The vLLM connector's start line reports a refused token at start (a user once
    served for an hour storing nothing): the start probe records who refused and why."""
    ns = make_ns("refused-at-start")
    with LocalCluster(
        servers=1, capacity="64MiB", slab_size="16MiB", extra_args=["--auth-token", "s3cret"]
    ) as c:
        with KVCacheClient(c.redis_url, ns, timeout=2, auth_token="wrong") as cl:
            status = cl.start_status()
            assert (
                status.index_reached
                and status.nodes == ["node-0"]
                and list(status.refused) == ["node-0"]
            )
        with KVCacheClient(c.redis_url, ns, timeout=2, auth_token="s3cret") as cl:
            assert cl.start_status().refused == {}
