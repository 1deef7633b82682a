"""The client library against real storage nodes: insert/select, paged API, placement,
replicas, faults. Cross-process cases run the other side in tests/worker.py."""

from __future__ import annotations

import time

import pytest
import torch

from client import KVCacheClient
from client.nodes.placement import place
from kvstore import InvalidInputError, Namespace, block_hashes
from kvstore.errors import CredentialError
from kvstore.index import PageIndex
from kvstore.pages import keys
from kvstore.tools.launcher import LocalCluster
from tests.helpers import corrupt_entry_checksums, kv_for, pages_for, run_worker, tenant_for

BLOCK = 16


@pytest.fixture(scope="module", params=[1, 3], ids=["valkey", "cluster3"])
def cluster(request):
    """Two storage nodes on a single Valkey, then on a 3-shard Valkey cluster."""
    with LocalCluster(
        servers=2, capacity="512MiB", slab_size="16MiB", index_shards=request.param
    ) as c:
        yield c


@pytest.fixture(scope="module")
def single_index_cluster():
    """Two storage nodes on a single Valkey, for data-path tests the index shape does not touch."""
    with LocalCluster(servers=2, capacity="512MiB", slab_size="16MiB") as c:
        yield c


def make_ns(tenant: str, **over) -> Namespace:
    fields = dict(
        model="client-test",
        dtype="float16",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        block_size=BLOCK,
        hidden_size=64,
        tenant=tenant,
    )
    fields.update(over)
    return Namespace(**fields)


@pytest.fixture()
def ns(request) -> Namespace:
    return make_ns(tenant_for(request.node.name))


@pytest.fixture()
def client(cluster, ns):
    c = KVCacheClient(cluster.redis_url, ns, timeout=5)
    yield c
    c.close()


def same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def insert(client, tokens, hidden=True):
    key, value, h = kv_for(client.namespace, tokens)
    roi = torch.ones(len(tokens), dtype=torch.bool)
    return client.insert(torch.tensor(tokens), roi, key, value, h if hidden else None), (
        key,
        value,
        h,
    )


def select(client, tokens):
    return client.select(torch.tensor(tokens), torch.ones(len(tokens), dtype=torch.bool))


def test_insert_in_one_process_select_in_another(cluster, ns):
    spec = {"redis_url": cluster.redis_url, "namespace": ns.model_dump(), "count": 10 * BLOCK + 5}
    inserted = run_worker({**spec, "op": "insert"})
    assert inserted["report"]["refused"] == 0 and inserted["report"]["sent"] >= 11
    got = run_worker({**spec, "op": "select"})
    assert got == {**got, "matched": 10 * BLOCK + 5, "exact": True, "hidden": True}
    nodes_used = {n.node_id for n in PageIndex(cluster.redis_url).live_nodes()}
    assert nodes_used == {"node-0", "node-1"}


def test_exact_sequence_returns_everything_and_hidden(client):
    tokens = list(range(3 * BLOCK + 7))
    _, (key, value, hidden) = insert(client, tokens)
    out_tokens, roi, k, v, h = select(client, tokens)
    assert int(roi.sum()) == len(tokens) and roi.all()
    assert same(k, key) and same(v, value) and same(h, hidden)
    assert out_tokens.tolist() == tokens


def test_shared_prefix_with_diverging_tail_returns_block_aligned_prefix(client):
    tokens = list(range(5 * BLOCK + 3))
    _, (key, value, _) = insert(client, tokens)
    other = tokens[: 3 * BLOCK + 4] + [9999] * (2 * BLOCK)
    _, roi, k, v, h = select(client, other)
    assert int(roi.sum()) == 3 * BLOCK and roi[: 3 * BLOCK].all() and not roi[3 * BLOCK :].any()
    assert h is None
    assert same(k, key[:, : 3 * BLOCK]) and same(v, value[:, : 3 * BLOCK])


def test_prompt_shorter_than_one_block(client):
    tokens = [7, 8, 9]
    _, (key, value, hidden) = insert(client, tokens)
    _, roi, k, v, h = select(client, tokens)
    assert int(roi.sum()) == 3 and same(k, key) and same(v, value) and same(h, hidden)
    assert (
        select(client, [7, 8]) == [None] * 5
    )  # a different short prompt: nothing block-aligned to share


def test_prompt_that_is_an_exact_multiple_of_the_block_size(client):
    tokens = list(range(100, 100 + 4 * BLOCK))
    _, (key, value, hidden) = insert(client, tokens)
    _, roi, k, v, h = select(client, tokens)
    assert int(roi.sum()) == 4 * BLOCK and same(k, key) and same(h, hidden)
    assert client.lookup(tokens) == 4 * BLOCK


def test_insert_without_hidden_returns_exact_kv_and_no_hidden(client):
    tokens = list(range(500, 500 + 2 * BLOCK + 1))
    _, (key, value, _) = insert(client, tokens, hidden=False)
    _, roi, k, v, h = select(client, tokens)
    assert int(roi.sum()) == len(tokens) and h is None and same(k, key) and same(v, value)


def test_roi_marks_the_prefix_that_is_stored_and_looked_up(client):
    tokens = list(range(1000, 1000 + 3 * BLOCK))
    key, value, hidden = kv_for(client.namespace, tokens)
    roi = torch.zeros(len(tokens), dtype=torch.bool)
    roi[: 2 * BLOCK] = True
    client.insert(torch.tensor(tokens), roi, key, value, hidden)
    _, out_roi, k, _, h = client.select(torch.tensor(tokens), roi)
    assert (
        int(out_roi.sum()) == 2 * BLOCK and same(k, key[:, : 2 * BLOCK]) and h.shape[0] == 2 * BLOCK
    )


def test_second_session_sends_only_missing_pages_and_matches_shared_blocks(client):
    a = list(range(2000, 2000 + 8 * BLOCK))
    first, _ = insert(client, a)
    assert first.sent == 8 + 1 and first.skipped == 0  # 8 blocks + 1 tail part
    k = 5
    b = a[: k * BLOCK] + list(range(9000, 9000 + 3 * BLOCK))
    second, _ = insert(client, b)
    assert second.skipped == k and second.sent == 3 + 1
    sent_bytes = second.bytes_sent
    assert sent_bytes < 4 * client.namespace.page_nbytes + 1024 * 1024
    c = a[: k * BLOCK] + [1] * (2 * BLOCK)
    _, roi, _, _, h = select(client, c)
    assert int(roi.sum()) == k * BLOCK and h is None


def test_paged_api_staged_and_direct_give_identical_tensors(cluster, ns):
    tokens = list(range(40 * BLOCK + 3))
    pages = pages_for(ns, tokens)
    with (
        KVCacheClient(cluster.redis_url, ns, transfer_mode="direct") as direct,
        KVCacheClient(cluster.redis_url, ns, transfer_mode="staged") as staged,
    ):
        assert direct.put_pages(tokens, pages).stored == 40
        out_direct = torch.full((48, *ns.page_shape), 7, dtype=torch.float16)
        out_staged = torch.full((48, *ns.page_shape), 9, dtype=torch.float16)
        assert direct.get_pages(tokens, out_direct) == 40 * BLOCK
        assert staged.get_pages(tokens, out_staged) == 40 * BLOCK
        assert same(out_direct[:40], out_staged[:40]) and same(out_direct[:40], pages)
        assert (
            direct.stats.direct_transfers == 1
            and staged.stats.staged_transfers == 1
            and direct.stats.staged_transfers == 0
        )


@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "ucx"])
@pytest.mark.parametrize("page_kib", [64, 2048])
def test_every_data_path_moves_pages_bit_exact_across_processes(
    single_index_cluster, same_host, page_kib
):
    """Put in one process, get in another, over shared memory (kvstore.wire.shm) and over
    UCX, straight into the caller's tensor and through staging, with pages the node
    does not hold mixed in (a shorter prefix)."""
    cluster = single_index_cluster
    from tests.helpers import namespace_for_page_size, spec

    ns = namespace_for_page_size(page_kib << 10, tenant=f"paths-{same_host}-{page_kib}")
    tokens = list(range(12 * ns.block_size))
    options = {"same_host": same_host}
    stored = run_worker(
        spec(cluster, ns, "put_pages", tokens=tokens[: 8 * ns.block_size], options=options)
    )
    assert (
        stored["reports"][0]["stored"] == 8
        and (stored["stats"]["same_host_transfers"] > 0) == same_host
    )
    for mode in ("direct", "staged"):
        got = run_worker(
            spec(
                cluster, ns, "get_pages", tokens=tokens, options={**options, "transfer_mode": mode}
            )
        )
        assert got["results"] == [{"blocks": 12, "matched": 8, "exact": True}]
        assert (got["stats"]["same_host_transfers"] > 0) == same_host
        assert got["stats"][f"{mode}_transfers"] == 1


def test_namespaces_never_match_each_other(cluster, ns):
    tokens = list(range(4 * BLOCK))
    with KVCacheClient(cluster.redis_url, ns) as writer:
        insert(writer, tokens)
        assert writer.lookup(tokens) == 4 * BLOCK
    for over in (
        {"model": "another"},
        {"dtype": "bfloat16"},
        {"tp_rank": 1, "tp_size": 2},
        {"tenant": "x"},
    ):
        other = ns.model_copy(update=over)
        other = Namespace.model_validate(other.model_dump())
        with KVCacheClient(cluster.redis_url, other) as reader:
            assert reader.lookup(tokens) == 0
            assert select(reader, tokens) == [None] * 5


def test_corrupt_checksum_counts_as_missing(cluster, ns, client):
    tokens = list(range(6 * BLOCK))
    client.put_pages(tokens, pages_for(ns, tokens))
    assert corrupt_entry_checksums(cluster.redis_url, ns, block_hashes(ns, tokens), 2) >= 1
    out = torch.empty(6, *ns.page_shape, dtype=torch.float16)
    assert client.get_pages(tokens, out) == 2 * BLOCK
    assert client.stats.checksum_failures == 1
    assert same(out[:2], pages_for(ns, tokens)[:2])


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda c, t: c.select(t, torch.tensor([True, False, True] + [False] * (len(t) - 3))),
            "prefix",
        ),
        (lambda c, t: c.select(t, torch.ones(len(t) - 1, dtype=torch.bool)), "shaped like"),
        (lambda c, t: c.select(t, torch.zeros(len(t), dtype=torch.bool)), "marks no tokens"),
        (lambda c, t: c.select(t, torch.ones(len(t), dtype=torch.int64)), "bool mask"),
        (
            lambda c, t: c.insert(
                t,
                torch.ones(len(t), dtype=torch.bool),
                torch.zeros(2, len(t), 2, 31, dtype=torch.float16),
                torch.zeros(2, len(t), 2, 32, dtype=torch.float16),
            ),
            "key has shape",
        ),
        (
            lambda c, t: c.insert(
                t,
                torch.ones(len(t), dtype=torch.bool),
                torch.zeros(2, len(t), 2, 32),
                torch.zeros(2, len(t), 2, 32),
            ),
            "dtype",
        ),
        (
            lambda c, t: c.get_pages(t, torch.zeros(1, 2, 2, BLOCK, 2, 32, dtype=torch.float16)),
            "at least 2",
        ),
        (
            lambda c, t: c.put_pages(t, torch.zeros(2, 3, 3, dtype=torch.float16)),
            "pages have shape",
        ),
    ],
)
def test_misuse_raises_value_errors_naming_the_problem(client, call, message):
    tokens = torch.arange(2 * BLOCK)
    with pytest.raises(InvalidInputError, match=message):
        call(client, tokens)


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
            with KVCacheClient(c.redis_url, ns) as writer:
                assert writer.put_pages(tokens, pages_for(ns, tokens)).stored == 40
            index = PageIndex(c.redis_url)
            result = index.lookup(ns, block_hashes(ns, tokens), lease_ms=0).resolve(
                index.live_nodes()
            )
            assert {loc.node_id for locs in result.locations for loc in locs} == {
                "node-0",
                "node-late",
            }
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
def test_a_stale_node_list_whose_registry_read_fails_keeps_the_last_list():
    """When the registry's shard is down but the lookup's segment is elsewhere, a lookup
    after the background read failed still answers, from the last list it had, and
    counts the fault; nothing is raised."""
    ns = make_ns("stale-list-fault")
    tokens = list(range(8 * BLOCK))
    with LocalCluster(servers=1, capacity="128MiB", slab_size="16MiB", index_shards=3) as c:
        index = PageIndex(c.redis_url)
        index.ping()
        topology = index._router.topology
        registry = topology.shard_of(keys.NODES_ZSET)
        segment = topology.shard_of(
            keys.segment_key(ns.storage.key.prefix, block_hashes(ns, tokens)[0])
        )
        if segment == registry:  # one segment, 8 blocks: move the prompt until it lies elsewhere
            tokens = next(
                t
                for t in (list(range(k, k + 8 * BLOCK)) for k in range(1, 10_000))
                if topology.shard_of(
                    keys.segment_key(ns.storage.key.prefix, block_hashes(ns, t)[0])
                )
                != registry
            )
        index.close()
        with KVCacheClient(c.redis_url, ns, node_refresh=0.3, timeout=1.0) as client:
            assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 8
            assert client.find(tokens).tokens == 8 * BLOCK
            c.valkey.shards[registry].stop()
            directory = client._async.nodes
            deadline = time.monotonic() + 10
            while not directory._read_failed:  # the background read found the registry down
                assert time.monotonic() < deadline, "the background read never failed"
                client.find(tokens)  # keeps the client in use, so the reads go on
                time.sleep(0.05)
            faults = client.stats.index_errors
            assert client.find(tokens).tokens == 8 * BLOCK  # the last list names the node
            assert client.stats.index_errors > faults  # deciding on the last list is counted


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


def test_async_client_on_its_own_event_loop(cluster):
    import json
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "async_client_script.py"), cluster.redis_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # 5 full blocks + 1 tail part, each on two replicas; lookup and get_pages ran concurrently
    assert result == {
        "sent": 12,
        "matched": 83,
        "exact": True,
        "lookup": 80,
        "pages": 80,
        "pages_exact": True,
    }


@pytest.mark.parametrize("block_major", [True, False], ids=["block-major", "layer-major"])
@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "ucx"])
def test_get_found_into_writes_pages_straight_into_a_strided_cache(
    cluster, same_host, block_major, monkeypatch
):
    """``get_found_into`` lands every verified page in the blocks of a paged cache whose
    layers are strided views (``PagedCache.block_spans``), from ``start_block`` on;
    blocks it was not asked for stay as they were, and a corrupted page ends the prefix.
    A block-major cache (each block's layers back to back) gives contiguous spans, so
    UCX receives consecutive blocks straight into it, with no scratch buffer; a
    layer-major one lands each run in one scratch buffer first."""
    from client.memory.staging import HostBuffers
    from client.paging.paged_cache import PagedCache

    ns = make_ns(f"into-{same_host}-{block_major}", layout="vllm_cpu", num_layers=3)
    n = 6
    tokens = list(range(n * BLOCK))
    pages = pages_for(ns, tokens)  # [n, L, H, B, KV]
    L = ns.num_layers
    if (
        block_major
    ):  # per layer [blocks, H, B, KV], blocks interleaved with the other layers' in memory
        storage = torch.zeros((20, L, *ns.page_shape[1:]), dtype=pages.dtype)
        cache = PagedCache([storage[:, layer] for layer in range(L)])
    else:
        cache = PagedCache(
            [torch.zeros((20, *ns.page_shape[1:]), dtype=pages.dtype) for _ in range(L)]
        )
    block_ids = [17, 3, 6, 7, 8, 9]  # those fetched are consecutive: one message can land in place
    assert all(bool(s.pieces) != block_major for s in cache.block_spans(block_ids))
    scratch = []
    take = HostBuffers.take_buffer
    monkeypatch.setattr(
        HostBuffers,
        "take_buffer",
        lambda self, nbytes: scratch.append(nbytes) or take(self, nbytes),
    )
    with KVCacheClient(cluster.redis_url, ns, same_host=same_host) as client:
        assert client.put_pages(tokens, pages).stored == n
        found = client.find(tokens)
        assert found.blocks == n
        scratch.clear()
        assert client.get_found_into(found, cache.block_spans(block_ids[2:]), start_block=2) == len(
            tokens
        )
        assert bool(scratch) == (not same_host and not block_major), scratch
        got = cache.gather(block_ids).wait()
        assert torch.equal(got[2:].view(torch.int16), pages[2:].view(torch.int16))
        assert not got[:2].view(torch.int16).any()  # blocks before start_block untouched
        assert corrupt_entry_checksums(cluster.redis_url, ns, block_hashes(ns, tokens), 4) == 1
        fresh = client.find(tokens)
        assert (
            client.get_found_into(fresh, cache.block_spans(block_ids), start_block=0) == 4 * BLOCK
        )
        with pytest.raises(InvalidInputError, match="sinks"):
            client.get_found_into(fresh, cache.block_spans(block_ids[:2]))


def _mapped_slabs(client: KVCacheClient) -> set[int]:
    """Slabs the client's same-host connections map, once its start's probes are done."""
    deadline = time.monotonic() + 10
    while not client._async._connecting.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {
        region
        for conn in client._async.nodes._conns.values()
        for region in getattr(conn, "_maps", {})
    }


def test_a_fresh_same_host_client_maps_its_tenants_slabs_at_start(cluster):
    """A same-host client's start probe is lent its tenant's slabs read-only
    (server/dataplane/same_host.py PROBE_MAP_BYTES), so its first get maps nothing; another
    tenant's client is lent none of them."""
    mine, other = make_ns("probe-maps"), make_ns("probe-maps-other")
    tokens = list(range(6 * BLOCK))
    pages = pages_for(mine, tokens)
    with KVCacheClient(cluster.redis_url, mine) as writer:
        assert writer.put_pages(tokens, pages).stored == 6
        written = _mapped_slabs(writer)
    assert written
    with KVCacheClient(cluster.redis_url, mine) as reader:
        assert _mapped_slabs(reader) >= written  # before any get
        out = torch.zeros_like(pages)
        assert reader.get_pages(tokens, out) == len(tokens)
        assert torch.equal(out.view(torch.int16), pages.view(torch.int16))
    with KVCacheClient(cluster.redis_url, other) as stranger:
        assert not _mapped_slabs(stranger) & written


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


def test_device_memory_is_reached_through_checked_host_staging(cluster, ns):
    """A get into device memory that no device copier of the client reaches (here: the
    meta device; CUDA's is tests/test_device_loads.py) lands in pinned host memory,
    where each page is checked against its checksum, then moves in one copy; asking for
    it 'direct' is refused by name (a check that read host memory failed: a silent miss)."""
    with KVCacheClient(cluster.redis_url, ns, timeout=5, same_host=False) as cl:
        device = torch.empty(1, device="meta")  # any memory but the host's
        assert cl._async._mode_for(device) == "staged"
    with KVCacheClient(
        cluster.redis_url, ns, timeout=5, same_host=False, transfer_mode="direct"
    ) as cl:
        with pytest.raises(
            InvalidInputError, match="transfer_mode='direct' into meta memory needs a device copier"
        ):
            cl._async._mode_for(device)
        assert (
            cl._async._mode_for(torch.empty(1)) == "direct"
        )  # host memory: checked where it lands


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


def test_put_pages_from_a_later_block_extends_a_stored_prefix(client):
    """``start_block``: a caller holding only the pages past a stored prefix (the vLLM
    connector's hybrid engines after a hit) stores them as those blocks, placed in the
    segments a lookup from block 0 reads, across a segment boundary; alone they extend
    nothing (the blocks before them are not stored)."""
    tokens = list(range(70 * BLOCK + 5))  # 70 full blocks: two segments of the index
    pages = pages_for(client.namespace, tokens)
    assert client.put_pages(tokens[: 40 * BLOCK], pages[:40]).refused == 0
    assert client.put_pages(tokens, pages[40:], start_block=40).refused == 0
    out = torch.zeros_like(pages)
    assert client.get_pages(tokens, out) == 70 * BLOCK and same(out, pages)
    other = [t + 100_000 for t in tokens]  # a chain whose first 66 blocks were never stored
    assert (
        client.put_pages(other, pages_for(client.namespace, other)[66:], start_block=66).refused
        == 0
    )
    assert client.find(other).blocks == 0
    with pytest.raises(
        InvalidInputError, match="start_block 71 must lie within the 70 full blocks"
    ):
        client.put_pages(tokens, pages[:0], start_block=71)
