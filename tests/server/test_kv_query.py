"""The prefix query API (server/query.py) on a real node's metrics port, over pages a
real client put, against a real Valkey: what it answers is what the client's own
lookup finds, per namespace, node and tier, and a tenant's token sees only its tenant."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from client import KVCacheClient
from kvstore import block_hashes
from kvstore.pages.identity import RequestIdentity
from kvstore.tools.launcher import LocalCluster
from tests.support.control_fixtures import metrics_address, post, post_raw
from tests.support.helpers import make_credentials, namespace_for_page_size, pages_for


def test_the_query_answers_what_the_clients_lookup_finds_per_namespace_node_and_tier(clusters):
    cluster = clusters(capacity="64MiB", slab="16MiB")
    ns = namespace_for_page_size(64 << 10, tenant="query-a")
    other = ns.model_copy(
        update={"block_size": ns.block_size * 2, "num_layers": 1}
    )  # same model, other geometry
    tokens = list(range(6 * ns.block_size + 5))
    salted = RequestIdentity(cache_salt="s1")
    with (
        KVCacheClient(cluster.redis_url, ns) as client,
        KVCacheClient(cluster.redis_url, other) as client2,
    ):
        stored = tokens[: 4 * ns.block_size]  # 4 of the 6 full blocks
        assert client.put_pages(stored, pages_for(ns, stored)).stored == 4
        assert (
            client.put_pages(
                stored[: 2 * ns.block_size], pages_for(ns, stored)[:2], identity=salted
            ).stored
            == 2
        )
        assert (
            client2.put_pages(
                stored[: other.block_size], pages_for(other, stored[: other.block_size])
            ).stored
            == 1
        )
        assert client.lookup(tokens) == 4 * ns.block_size
        addr = metrics_address(cluster)
        status, got = post(
            addr, "/v1/kv/query", {"model": ns.model, "token_ids": tokens, "tenant": ns.tenant}
        )
        assert status == 200, got
        by_size = {a["block_size"]: a for a in got["namespaces"]}
        assert set(by_size) == {ns.block_size, other.block_size}
        mine = by_size[ns.block_size]
        assert mine["namespace"] == ns.storage.digest_hex
        assert (mine["blocks"], mine["tokens"]) == (4, client.lookup(tokens))
        assert mine["nodes"] == [{"node_id": "node-0", "blocks": 4, "tiers": {"CPU": 4, "DISK": 0}}]
        assert by_size[other.block_size]["tokens"] == client2.lookup(tokens) == other.block_size
        assert (got["tokens"], got["blocks"], got["answered_by"]) == (
            4 * ns.block_size,
            4,
            "node-0",
        )
        # the same tokens as little-endian u32 in base64: the same answer
        b64 = base64.b64encode(np.asarray(tokens, dtype="<u4").tobytes()).decode()
        status, fast = post(
            addr, "/v1/kv/query", {"model": ns.model, "token_ids_b64": b64, "tenant": ns.tenant}
        )
        assert status == 200 and fast == got
        # and as the raw body, the other fields in the query string
        raw = urllib.request.Request(
            f"http://{addr}/v1/kv/query?model={ns.model}&tenant={ns.tenant}",
            np.asarray(tokens, dtype="<u4").tobytes(),
            {"Content-Type": "application/octet-stream"},
            method="POST",
        )
        with urllib.request.urlopen(raw, timeout=10) as resp:
            assert json.loads(resp.read()) == got
        # block_size picks one namespace; a salt keys other blocks; a prompt that diverges is shorter
        _, one = post(
            addr,
            "/v1/kv/query",
            {
                "model": ns.model,
                "token_ids": tokens,
                "tenant": ns.tenant,
                "block_size": other.block_size,
            },
        )
        assert [a["block_size"] for a in one["namespaces"]] == [other.block_size]
        _, salt = post(
            addr,
            "/v1/kv/query",
            {"model": ns.model, "token_ids": tokens, "tenant": ns.tenant, "cache_salt": "s1"},
        )
        assert (
            salt["namespaces"][0]["tokens"]
            == client.lookup(tokens, identity=salted)
            == 2 * ns.block_size
        )
        diverged = tokens[: 3 * ns.block_size - 1] + [999_999] + tokens[3 * ns.block_size :]
        _, short = post(
            addr,
            "/v1/kv/query",
            {
                "model": ns.model,
                "token_ids": diverged,
                "tenant": ns.tenant,
                "block_size": ns.block_size,
            },
        )
        assert short["tokens"] == client.lookup(diverged) == 2 * ns.block_size
        # by the store's block hashes (what the node's events carry)
        hexes = [h.hex() for h in block_hashes(ns.storage, tokens)]
        status, by_hash = post(
            addr,
            "/v1/kv/query_by_hash",
            {"namespace": ns.storage.digest_hex, "block_hashes": hexes, "tenant": ns.tenant},
        )
        assert (
            status == 200
            and by_hash["blocks"] == 4
            and by_hash["namespaces"][0]["nodes"][0]["blocks"] == 4
        )
        # other tenants' and unknown models' pages are not there
        _, none = post(
            addr,
            "/v1/kv/query",
            {"model": "no-such-model", "token_ids": tokens, "tenant": ns.tenant},
        )
        assert (none["tokens"], none["namespaces"]) == (0, [])
        _, elsewhere = post(
            addr, "/v1/kv/query", {"model": ns.model, "token_ids": tokens, "tenant": "default"}
        )
        assert elsewhere["tokens"] == 0


def test_pages_on_two_nodes_are_counted_per_node(clusters):
    cluster = clusters(servers=2, capacity="64MiB", slab="16MiB")
    ns = namespace_for_page_size(64 << 10, tenant="query-two")
    tokens = list(range(8 * ns.block_size))
    with KVCacheClient(cluster.redis_url, ns, replicas=2) as client:
        assert client.put_pages(tokens, pages_for(ns, tokens)).stored >= 8
        for node in ("node-0", "node-1"):
            _, got = post(
                metrics_address(cluster, node),
                "/v1/kv/query",
                {"model": ns.model, "token_ids": tokens, "tenant": ns.tenant},
            )
            nodes = {n["node_id"]: n for n in got["namespaces"][0]["nodes"]}
            assert got["tokens"] == len(tokens) and set(nodes) == {"node-0", "node-1"}
            assert all(n["blocks"] == 8 for n in nodes.values())
            # only the answering node tells its tiers
            assert (
                nodes[node]["tiers"] == {"CPU": 8, "DISK": 0}
                and "tiers" not in nodes[{"node-0": "node-1", "node-1": "node-0"}[node]]
            )


def test_bad_queries_get_a_clear_error(clusters):
    cluster = clusters(capacity="64MiB", slab="16MiB")
    addr = metrics_address(cluster)
    cases = [
        ({"token_ids": [1, 2]}, "model"),
        ({"model": "m"}, "token_ids or token_ids_b64"),
        ({"model": "m", "token_ids": [1, -2]}, "[0, 2**32)"),
        ({"model": "m", "token_ids_b64": "AAA"}, "base64"),
        ({"model": "m", "token_ids": [1], "tenant": "bad tenant!"}, "tenant"),
        ({"model": "m", "token_ids": [1], "colour": "red"}, "colour"),
        ({"model": "m", "token_ids": [[1], [2]]}, "list of integers"),
        ({"model": "m", "token_ids": [1, 2.5]}, "list of integers"),
        ({"model": "m", "token_ids": [1, 2**32]}, "[0, 2**32)"),
        ({"model": "m", "token_ids": "1,2"}, "list of integers"),
        ({"model": "m", "token_ids": [1], "token_ids_b64": "AQAAAA=="}, "one of them"),
    ]
    for body, words in cases:
        status, got = post(addr, "/v1/kv/query", body)
        assert status == 400 and words in got["error"], (body, got)
    status, got = post_raw(addr, "/v1/kv/query", b'{"model": "m", "token_ids": [1, 2')
    assert status == 400 and "not JSON" in got["error"]
    status, got = post(addr, "/v1/kv/query_by_hash", {"block_hashes": ["00" * 16]})
    assert status == 400 and "namespace" in got["error"]
    status, got = post(addr, "/v1/kv/query_by_hash", {"model": "m", "block_hashes": ["abc"]})
    assert status == 400 and "hex" in got["error"]
    status, got = post(addr, "/v1/kv/nothing", {})
    assert status == 404
    for query, body, words in (
        ("model=m", b"\x01\x00\x00", "u32"),
        ("tenant=t", b"", "model"),
        ("model=m&colour=red", b"", "colour"),
    ):
        req = urllib.request.Request(
            f"http://{addr}/v1/kv/query?{query}",
            body,
            {"Content-Type": "application/octet-stream"},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=10)
        assert exc.value.code == 400 and words in json.loads(exc.value.read())["error"]


@pytest.mark.process
def test_a_tenants_token_sees_only_its_tenants_pages(tmp_path):
    creds, token = make_credentials(
        tmp_path, ("alice", "readwrite", ["team-a"]), ("bob", "readwrite", ["team-b"])
    )
    tokens = list(range(4 * namespace_for_page_size(64 << 10).block_size))
    with LocalCluster(
        servers=1, capacity="64MiB", slab_size="16MiB", env={"KVSTORE_CREDENTIALS_FILE": str(creds)}
    ) as c:
        for who, tenant in (("alice", "team-a"), ("bob", "team-b")):
            ns = namespace_for_page_size(64 << 10, tenant=tenant)
            with KVCacheClient(c.redis_url, ns, auth_token_file=str(token[who])) as client:
                assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 4
        addr = metrics_address(c)
        alice = token["alice"].read_text().strip()
        model = namespace_for_page_size(64 << 10).model
        status, got = post(
            addr, "/v1/kv/query", {"model": model, "token_ids": tokens, "tenant": "team-a"}, alice
        )
        assert status == 200 and got["tokens"] == len(tokens)
        status, got = post(
            addr, "/v1/kv/query", {"model": model, "token_ids": tokens, "tenant": "team-b"}, alice
        )
        assert status == 403 and "team-b" in got["error"]
        status, got = post(
            addr, "/v1/kv/query", {"model": model, "token_ids": tokens, "tenant": "team-a"}
        )
        assert status == 401
        status, got = post(
            addr,
            "/v1/kv/query",
            {"model": model, "token_ids": tokens, "tenant": "team-a"},
            "wrong-token",
        )
        assert status == 401


@pytest.mark.parametrize("path", ["/v1/kv/query", "/v1/kv/query_by_hash"])
def test_an_oversized_body_is_refused_unread(clusters, path):
    cluster = clusters(capacity="64MiB", slab="16MiB")
    addr = metrics_address(cluster)
    req = urllib.request.Request(
        f"http://{addr}{path}", b"{}", {"Content-Length": str(64 << 20)}, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 413


def test_tiers_split_blocks_between_memory_and_disk(clusters, tmp_path):
    from tests.support.helpers import metrics, run_worker, spec, wait_for

    cluster = clusters(
        capacity="4MiB", slab="1MiB", disk_path=str(tmp_path / "disk"), disk_capacity="64MiB"
    )
    ns = namespace_for_page_size(256 << 10, tenant="query-disk")
    batches = [
        list(range(b * 100_000, b * 100_000 + 4 * ns.block_size)) for b in range(8)
    ]  # twice the pool
    reports = run_worker(
        spec(cluster, ns, "put_pages", token_lists=batches, options={"lease_ms": 0})
    )["reports"]
    assert sum(r["stored"] for r in reports) == 32
    addr = metrics_address(cluster)

    def tiers() -> list[dict]:
        out = []
        for b in batches:
            _, got = post(
                addr, "/v1/kv/query", {"model": ns.model, "token_ids": b, "tenant": ns.tenant}
            )
            out.append(got["namespaces"][0]["nodes"][0]["tiers"])
        return out

    def settled() -> (
        bool
    ):  # the demoter works in the background: until a query sees what the metrics say
        seen = tiers()
        return (
            sum(t["CPU"] for t in seen)
            == metrics(cluster, "node-0")['kvstore_tier_pages{tier="memory"}']
        )

    wait_for(settled, 20, "the tiers the query reports to match the node's memory pages")
    seen = tiers()
    assert all(
        t["CPU"] + t["DISK"] == 4 for t in seen
    )  # every block held, in one tier or the other
    assert sum(t["DISK"] for t in seen) > 0 and sum(t["CPU"] for t in seen) > 0


def test_a_json_query_after_a_refused_one_whose_error_is_kept_still_parses():
    """The parser kept per HTTP thread refuses to parse while an element of its last
    document lives, which a kept exception's frames can hold: the next query parses."""
    from server.query_body import json_query

    with pytest.raises(ValueError, match="list of integers") as kept:
        json_query(json.dumps({"model": "m", "token_ids": [1, "x"]}).encode())
    params, tokens = json_query(json.dumps({"model": "m", "token_ids": [6, 7]}).encode())
    assert params.model == "m" and tokens.tolist() == [6, 7] and kept.value is not None


def test_a_hybrid_models_pages_count_up_to_its_last_boundary_state(clusters):
    """A state-space hybrid's attention pages of 4 blocks, and its boundary states
    (a namespace of the sparse ``vllm_mamba_state`` layout, client.vllm.states) at block
    2 only: the query answers 2 blocks, what an engine can load, and lists the pages'
    namespace alone. With a state at block 4 too, all 4; another model's pages of the
    same geometry are not capped."""
    cluster = clusters(capacity="64MiB", slab="16MiB")
    ns = namespace_for_page_size(64 << 10, tenant="query-hybrid")
    states = ns.model_copy(
        update={
            "dtype": "int8",
            "layout": "vllm_mamba_state",
            "num_layers": 2,
            "num_kv_heads": 1,
            "head_size": 512,
        }
    )
    plain = ns.model_copy(update={"model": "plain-model"})
    tokens = list(range(6 * ns.block_size + 5))
    stored = tokens[: 4 * ns.block_size]
    addr = metrics_address(cluster)

    def answer(model: str) -> dict:
        status, got = post(
            addr, "/v1/kv/query", {"model": model, "token_ids": tokens, "tenant": ns.tenant}
        )
        assert status == 200, got
        return got

    with (
        KVCacheClient(cluster.redis_url, ns) as pages,
        KVCacheClient(cluster.redis_url, states) as boundary,
        KVCacheClient(cluster.redis_url, plain) as other,
    ):
        assert pages.put_pages(stored, pages_for(ns, stored)).stored == 4
        assert other.put_pages(stored, pages_for(plain, stored)).stored == 4
        state = pages_for(states, stored)[:1]
        assert boundary.put_pages(stored[: 2 * ns.block_size], state, start_block=1).stored == 1
        got = answer(ns.model)
        assert (got["blocks"], got["tokens"]) == (2, 2 * ns.block_size)
        assert [a["namespace"] for a in got["namespaces"]] == [ns.storage.digest_hex]
        assert answer(plain.model)["blocks"] == 4
        assert boundary.put_pages(stored, state, start_block=3).stored == 1
        assert answer(ns.model)["blocks"] == 4
