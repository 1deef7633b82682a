"""The operator control API (issue 73) attacked, as a script would: a node with
credentials refuses pin, unpin, prefetch, clear and residency of a tenant's prefixes to
any token that may not change (or read) that tenant, refuses bad bodies naming the
field, and lets the all-tenant operator token act. Nothing of the tenant's changed
after the refused attacks."""

from __future__ import annotations

from client import KVCacheClient
from tests.support.control_fixtures import (
    PAGE,
    act,
    by_hashes,
    by_tokens,
    metrics_address,
    post,
    post_raw,
    prompt,
    read_exact,
    residency,
)
from tests.support.helpers import make_credentials, metrics, namespace_for_page_size, pages_for

ACTIONS = ("pin", "unpin", "prefetch", "clear")


def test_control_requests_need_a_token_that_may_change_the_tenant(clusters, tmp_path):
    creds, files = make_credentials(
        tmp_path,
        ("alice", "readwrite", ["ctl-a"]),
        ("bob", "readwrite", ["ctl-b"]),
        ("alice-ro", "read", ["ctl-a"]),
        ("operator", "readwrite", ["*"]),
    )
    token = {name: path.read_text().strip() for name, path in files.items()}
    cluster = clusters(capacity="16MiB", slab="4MiB", env={"KVSTORE_CREDENTIALS_FILE": str(creds)})
    a = namespace_for_page_size(PAGE, tenant="ctl-a")
    b = a.model_copy(update={"tenant": "ctl-b"})
    tokens = prompt(a, 1, 8)
    for ns, name in ((a, "alice"), (b, "bob")):
        with KVCacheClient(cluster.redis_url, ns, auth_token_file=str(files[name])) as client:
            assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 8
    addr = metrics_address(cluster)
    alices = [by_tokens(a, tokens), by_hashes(a, tokens), {"tenant": a.tenant}]

    # bob (read-write on his own tenant) on alice's prefixes: every action, both forms
    for body in alices:
        for action in ACTIONS:
            if action != "clear" and "token_ids" not in body and "block_hashes" not in body:
                continue  # pin, unpin and prefetch need a prefix (a 400, below)
            status, answer = post(addr, f"/v1/kv/{action}", body, token["bob"])
            assert status == 403, (action, body, answer)
            assert "may not change pages of tenant ctl-a" in answer["error"], answer
    status, answer = post(
        addr, "/v1/kv/query", {**by_tokens(a, tokens), "residency": True}, token["bob"]
    )
    assert status == 403 and "may not read pages of tenant ctl-a" in answer["error"], answer
    status, answer = post(
        addr, "/v1/kv/query_by_hash", {**by_hashes(a, tokens), "residency": True}, token["bob"]
    )
    assert status == 403, answer
    # ... or under his own tenant, naming alice's namespace and hashes: nothing to act on
    for action in ACTIONS:
        smuggled = {**by_hashes(a, tokens), "tenant": b.tenant}
        assert act(addr, action, smuggled, token["bob"])["pages"] == 0, action
    cleared = act(
        addr, "clear", {"tenant": b.tenant, "namespace": a.storage.digest_hex}, token["bob"]
    )
    assert cleared["pages"] == 0
    # alice's read-only token reads where her prefix lives, but cannot change it
    assert len(residency(addr, a, tokens, token["alice-ro"])) == 8
    for action, body in (("pin", alices[0]), ("clear", alices[2]), ("unpin", alices[1])):
        status, answer = post(addr, f"/v1/kv/{action}", body, token["alice-ro"])
        assert status == 403 and "may not change" in answer["error"], (action, answer)
    # no token, or one no credential has
    for bad in (None, "not-a-token-" + "x" * 40):
        for action in ACTIONS:
            status, answer = post(addr, f"/v1/kv/{action}", alices[1], bad)
            assert status == 401 and "bearer token" in answer["error"], (action, answer)
        status, _ = post(addr, "/v1/kv/query", {**by_tokens(a, tokens), "residency": True}, bad)
        assert status == 401
    # bad bodies: 400, naming the field (even with alice's own token)
    bad_bodies = [
        ("pin", {**by_tokens(a, tokens), "ttl_s": -1}, "ttl_s"),
        ("pin", {**by_tokens(a, tokens), "ttl_s": "soon"}, "ttl_s"),
        ("pin", {"tenant": a.tenant, "model": a.model}, "token_ids"),
        ("unpin", {"tenant": a.tenant, "token_ids": [1, 2]}, "model"),
        ("prefetch", {**by_hashes(a, tokens), "block_hashes": ["xyz"]}, "block_hashes"),
        ("prefetch", {**by_tokens(a, tokens), "token_ids": [1, -2]}, "[0, 2**32)"),
        ("clear", {"tenant": "bad tenant!"}, "tenant"),
        ("clear", {"tenant": a.tenant, "colour": "red"}, "colour"),
        ("clear", {"tenant": a.tenant, "namespace": "abc"}, "namespace"),
        ("clear", {**by_tokens(a, tokens), **by_hashes(a, tokens)}, "not both"),
    ]
    for action, body, field in bad_bodies:
        status, answer = post(addr, f"/v1/kv/{action}", body, token["alice"])
        assert status == 400 and field in answer["error"], (action, body, answer)
    status, answer = post_raw(addr, "/v1/kv/clear", b"{not json", token["alice"])
    assert status == 400 and "invalid request" in answer["error"], answer

    # nothing of alice's changed: every page there, none pinned, bit-exact
    assert residency(addr, a, tokens, token["alice"]) == [
        {"block": i, "tier": "CPU", "pinned": False} for i in range(8)
    ]
    m = metrics(cluster, "node-0")
    assert m["kvstore_pages"] == 16
    assert not any(v for k, v in m.items() if k.startswith("kvstore_operator_pinned_pages{"))
    assert not any(v for k, v in m.items() if k.startswith("kvstore_cleared_pages_total{"))
    with KVCacheClient(cluster.redis_url, a, auth_token_file=str(files["alice"])) as alice:
        assert read_exact(alice, a, tokens) == 8

    # the operator's all-tenant token acts on alice's prefix
    op = token["operator"]
    assert act(addr, "pin", alices[0], op)["pages"] == 8
    assert all(b["pinned"] for b in residency(addr, a, tokens, op))
    assert act(addr, "unpin", alices[1], op)["pages"] == 8
    assert act(addr, "prefetch", alices[1], op)["pages"] == 0  # in memory already
    assert act(addr, "clear", alices[2], op)["pages"] == 8
    with KVCacheClient(cluster.redis_url, a, auth_token_file=str(files["alice"])) as alice:
        assert alice.lookup(tokens) == 0
    with KVCacheClient(cluster.redis_url, b, auth_token_file=str(files["bob"])) as bob:
        assert read_exact(bob, b, tokens) == 8
