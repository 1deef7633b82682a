"""The client's control calls (client/control.py over kvstore/control/caller.py) on real
storage node processes and a real Valkey: pin, unpin, prefetch, clear and where reach
every live node that holds the pages, add up what each did, and turn each node's
refusal into the error it means (a refused token, a pin over a node's limits) while a
node that cannot be reached is named, not fatal."""

from __future__ import annotations

import pytest

from client import KVCacheClient
from kvstore.errors import CredentialError, InvalidInputError, PinRefusedError
from kvstore.tools.launcher import LocalCluster
from tests.support.helpers import make_credentials, namespace_for_page_size, pages_for

PAGE = 64 << 10  # one page a block (one head group), 16 tokens a block


def prompt(seed: int, blocks: int, block_size: int) -> list[int]:
    return list(range(seed * 100_000, seed * 100_000 + blocks * block_size))


def put(client: KVCacheClient, tokens: list[int]) -> None:
    ns = client.namespace
    stored = client.put_pages(tokens, pages_for(ns, tokens)).stored
    assert stored == len(tokens) // ns.block_size


def table(client: KVCacheClient, tokens: list[int]) -> dict[str, tuple[int, int, int]]:
    """node id -> (blocks in memory, on disk, pinned) of ``tokens`` in the client's namespace."""
    digest = client.namespace.storage.digest_hex
    return {
        r.node_id: (r.memory, r.disk, r.pinned)
        for r in client.where(tokens).summary()
        if r.namespace == digest
    }


def test_each_call_reaches_every_replica_and_adds_up(clusters):
    cluster = clusters(servers=2, capacity="64MiB", slab="16MiB")
    ns = namespace_for_page_size(PAGE, tenant="control-calls")
    a, b = prompt(1, 4, ns.block_size), prompt(2, 2, ns.block_size)
    with KVCacheClient(cluster.redis_url, ns, replicas=2, lease_ms=0) as client:
        put(client, a)
        put(client, b)
        where = client.where(a + [7])  # a partial block is not named
        assert where.stored == {ns.storage.digest_hex: 4} and not where.unreachable
        assert table(client, a) == {"node-0": (4, 0, 0), "node-1": (4, 0, 0)}
        holders = where.holders()[ns.storage.digest_hex]
        assert sorted(holders) == [0, 1, 2, 3]
        assert all([h.node_id for h in hs] == ["node-0", "node-1"] for hs in holders.values())

        pinned = client.pin(a, ttl_s=60)
        assert (pinned.action, pinned.pages, pinned.memory, pinned.disk, pinned.missing) == (
            "pin",
            8,
            8,
            0,
            0,
        )
        assert pinned.bytes >= 8 * PAGE and not pinned.unreachable
        assert [(n.node_id, n.pages, n.blocks) for n in pinned.nodes] == [
            ("node-0", 4, 4),
            ("node-1", 4, 4),
        ]
        assert table(client, a) == {"node-0": (4, 0, 4), "node-1": (4, 0, 4)}
        ttls = [r.shortest_ttl_s for r in client.where(a).summary()]
        assert all(t is not None and 45 < t <= 60 for t in ttls), ttls
        # a prefix longer than what is stored: the blocks no node holds are missing on each
        more = client.pin(a + prompt(3, 1, ns.block_size))
        assert (more.pages, more.missing) == (8, 2)
        assert all(r.shortest_ttl_s is None for r in client.where(a).summary())  # until unpinned

        assert client.unpin(a).pages == 8
        assert table(client, a) == {"node-0": (4, 0, 0), "node-1": (4, 0, 0)}
        fetched = client.prefetch(a)  # in memory already: nothing to bring in
        assert (fetched.action, fetched.pages, fetched.missing) == ("prefetch", 0, 0)

        cleared = client.clear(a[: 2 * ns.block_size])
        assert (cleared.action, cleared.pages) == ("clear", 4)
        assert client.lookup(a) == 0 and client.lookup(b) == len(b)
        # blocks 2 and 3 are still held (a lookup stops at the first missing block)
        assert table(client, a) == {"node-0": (2, 0, 0), "node-1": (2, 0, 0)}
        assert sorted(client.where(a).holders()[ns.storage.digest_hex]) == [2, 3]
        cleared = client.clear()  # the client's whole namespace
        assert cleared.pages == 2 * 2 + 2 * 2  # b's 2 blocks, a's last 2, on both nodes
        assert client.lookup(b) == 0


def test_a_tenant_wide_clear_leaves_other_tenants_pages(clusters):
    cluster = clusters(servers=1, capacity="64MiB", slab="16MiB")
    ns = namespace_for_page_size(PAGE, tenant="control-mine")
    other_model = ns.model_copy(update={"model": "another-model"})
    theirs = ns.model_copy(update={"tenant": "control-theirs"})
    tokens = prompt(4, 2, ns.block_size)
    with (
        KVCacheClient(cluster.redis_url, ns) as mine,
        KVCacheClient(cluster.redis_url, other_model) as mine_too,
        KVCacheClient(cluster.redis_url, theirs) as other,
    ):
        for client in (mine, mine_too, other):
            put(client, tokens)
        with pytest.raises(InvalidInputError, match="not both"):
            mine.clear(tokens, tenant_wide=True)
        with pytest.raises(InvalidInputError, match="no full block"):
            mine.pin(tokens[:3])
        with pytest.raises(InvalidInputError, match="ttl_s"):
            mine.pin(tokens, ttl_s=-1)
        assert mine.clear().pages == 2  # its namespace only
        assert mine_too.lookup(tokens) == len(tokens)
        assert mine.clear(tenant_wide=True).pages == 2  # the other model's, of the same tenant
        assert mine_too.lookup(tokens) == 0 and other.lookup(tokens) == len(tokens)


def test_a_refused_pin_and_a_dead_node_are_reported_and_the_other_pins_stand(clusters):
    cluster = clusters(servers=1, capacity="64MiB", slab="16MiB")
    cluster.add_node("node-1", ["--pin-max-share", "0"])  # refuses every pin
    doomed = cluster.add_node("node-2", ["--node-ttl", "120"])  # listed long after it dies
    cluster.wait_registered()
    ns = namespace_for_page_size(PAGE, tenant="control-refused")
    tokens = prompt(5, 3, ns.block_size)
    with KVCacheClient(cluster.redis_url, ns, replicas=3, lease_ms=0) as client:
        put(client, tokens)
        doomed.kill()
        doomed.process.wait(10)
        with pytest.raises(PinRefusedError) as exc:
            client.pin(tokens, ttl_s=600)
        err = exc.value
        assert list(err.refusals) == ["node-1"] and "--pin-max-share" in err.refusals["node-1"]
        assert "node node-1 (" in str(err) and "the pins of node-0 stand" in str(err)
        assert [n.node_id for n in err.accepted.nodes] == ["node-0"] and err.accepted.pages == 3
        assert list(err.accepted.unreachable) == ["node-2"]
        where = client.where(tokens)
        assert list(where.unreachable) == ["node-2"]
        assert table(client, tokens) == {"node-0": (3, 0, 3), "node-1": (3, 0, 0)}
        report = client.unpin(tokens)
        assert [n.node_id for n in report.nodes] == ["node-0", "node-1"]
        assert report.pages == 3 and "refused" in report.unreachable["node-2"].lower()


@pytest.mark.process
def test_a_token_without_the_right_raises_and_a_read_token_may_ask_where(tmp_path):
    creds, token = make_credentials(
        tmp_path, ("writer", "readwrite", ["control-auth"]), ("reader", "read", ["control-auth"])
    )
    ns = namespace_for_page_size(PAGE, tenant="control-auth")
    tokens = prompt(6, 2, ns.block_size)
    with LocalCluster(
        servers=2, capacity="64MiB", slab_size="16MiB", env={"KVSTORE_CREDENTIALS_FILE": str(creds)}
    ) as cluster:
        with KVCacheClient(
            cluster.redis_url, ns, replicas=2, auth_token_file=str(token["writer"])
        ) as writer:
            put(writer, tokens)
            assert writer.pin(tokens).pages == 4
        with KVCacheClient(cluster.redis_url, ns, auth_token_file=str(token["reader"])) as reader:
            assert table(reader, tokens) == {"node-0": (2, 0, 2), "node-1": (2, 0, 2)}
            with pytest.raises(CredentialError) as exc:
                reader.clear()
            assert exc.value.node_ids == ["node-0", "node-1"]
            assert exc.value.tenant == "control-auth" and exc.value.operation == "clear"
            assert "may not change pages of tenant control-auth" in str(exc.value)
        with KVCacheClient(cluster.redis_url, ns, auth_token="wrong-token") as stranger:
            with pytest.raises(CredentialError, match="matches no credential"):
                stranger.where(tokens)
