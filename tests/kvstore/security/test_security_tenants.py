"""Tenants kept apart: data-plane credentials per tenant (no writes into or reads of
another tenant's pages, rotation without a restart, no node without a credential) and
the index's ACL roles (the documented rules, confined tenants, no flushing another's
pages)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis
import torch

from client import KVCacheClient
from client.memory.buffers import Span, host_bytes
from kvstore.index import PageIndex
from kvstore.tools.valkey import EmbeddedValkey
from tests.support.helpers import KVSTORE_CLI as KVSTORE
from tests.support.helpers import (
    ROOT,
    as_bytes,
    cli_env,
    make_credentials,
    namespace_for_page_size,
    pages_for,
    wait_for,
)
from tests.support.security import make_ns

ENV = cli_env()  # no token: each test hands its processes the one it means


@pytest.mark.process
@pytest.mark.parametrize("same_host", [True, False], ids=["shm", "ucx"])
def test_a_tenant_cannot_write_pages_into_another_tenants_namespace(tmp_path, same_host):
    """Finding 1: with one token for everyone, alice stored pages under bob's namespace
    first, bob's own put found them present, and bob read alice's bytes back."""
    from kvstore.tools.launcher import LocalCluster

    creds, token = make_credentials(
        tmp_path, ("alice", "readwrite", ["team-a"]), ("bob", "readwrite", ["team-b"])
    )
    ns = make_ns("team-b")
    tokens = list(range(4 * ns.block_size))
    genuine = pages_for(ns, tokens)
    poison = torch.ones_like(genuine)
    with LocalCluster(
        servers=1, capacity="64MiB", slab_size="16MiB", env={"KVSTORE_CREDENTIALS_FILE": str(creds)}
    ) as c:
        with KVCacheClient(
            c.redis_url, ns, auth_token_file=str(token["alice"]), timeout=3, same_host=same_host
        ) as alice:
            with pytest.raises(PermissionError, match="tenant 'team-b'"):
                alice.put_pages(tokens, poison)
            assert (
                alice.stats.credential_refusals >= 1 and alice.stats.node_errors == 0
            )  # the node is not suspected
        with KVCacheClient(
            c.redis_url, ns, auth_token_file=str(token["bob"]), same_host=same_host
        ) as bob:
            assert bob.put_pages(tokens, genuine).stored == 4
            out = torch.zeros_like(genuine)
            assert bob.get_pages(tokens, out) == len(tokens)
            assert torch.equal(as_bytes(out), as_bytes(genuine))


@pytest.mark.process
@pytest.mark.parametrize("same_host", [True, False], ids=["shm", "ucx"])
def test_a_tenant_cannot_read_another_tenants_pages(tmp_path, same_host):
    """Finding 2: a client of one tenant found another tenant's page hashes in the index
    and read the pages, bit-identical. A read-only credential reads but cannot write."""
    from kvstore.tools.launcher import LocalCluster

    creds, token = make_credentials(
        tmp_path,
        ("alice", "readwrite", ["team-a"]),
        ("bob", "readwrite", ["team-b"]),
        ("auditor", "read", ["team-b"]),
    )
    ns = make_ns("team-b")
    tokens = list(range(4 * ns.block_size))
    genuine = pages_for(ns, tokens)
    with LocalCluster(
        servers=1, capacity="64MiB", slab_size="16MiB", env={"KVSTORE_CREDENTIALS_FILE": str(creds)}
    ) as c:
        with KVCacheClient(
            c.redis_url, ns, auth_token_file=str(token["bob"]), same_host=same_host
        ) as bob:
            assert bob.put_pages(tokens, genuine).stored == 4
        with KVCacheClient(
            c.redis_url, ns, auth_token_file=str(token["alice"]), timeout=3, same_host=same_host
        ) as alice:
            assert alice.lookup(tokens) == len(
                tokens
            )  # the index still answers (index ACLs confine it: docs/security.md)
            out = torch.zeros_like(genuine)
            with pytest.raises(PermissionError, match="refused to read pages of tenant 'team-b'"):
                alice.get_pages(tokens, out)
            assert not as_bytes(out).any()
        other = make_ns("team-b").model_copy(update={"model": "another-model"})
        with KVCacheClient(
            c.redis_url, ns, auth_token_file=str(token["auditor"]), timeout=3, same_host=same_host
        ) as auditor:
            out = torch.zeros_like(genuine)
            assert auditor.get_pages(tokens, out) == len(tokens)
            assert torch.equal(as_bytes(out), as_bytes(genuine))
        with (
            KVCacheClient(
                c.redis_url,
                other,
                auth_token_file=str(token["auditor"]),
                timeout=3,
                same_host=same_host,
            ) as auditor,
            pytest.raises(PermissionError, match="forbidden"),
        ):  # read rights only
            auditor.put_pages(tokens, pages_for(other, tokens))


@pytest.mark.process
def test_credentials_rotate_without_a_restart(tmp_path):
    """A new credential works once its line is in the file, a removed one stops working,
    and a malformed file keeps the credentials loaded before; the node never restarts."""
    from kvstore.tools.launcher import LocalCluster

    creds, token = make_credentials(tmp_path, ("old", "readwrite", ["team-a"]))
    (tmp_path / "next").mkdir()
    _, new_token = make_credentials(tmp_path / "next", ("new", "readwrite", ["team-a"]))
    new_line = (tmp_path / "next" / "credentials").read_text()
    ns = make_ns("team-a")

    def replace(text: str) -> None:  # as a Kubernetes Secret update does: a new file, renamed over
        (tmp_path / "staged").write_text(text)
        os.replace(tmp_path / "staged", creds)

    def stores(client, first: int) -> bool:
        tokens = list(range(first, first + 2 * ns.block_size))
        try:
            return client.put_pages(tokens, pages_for(ns, tokens)).stored == 2
        except PermissionError:
            return False

    with LocalCluster(
        servers=1, capacity="64MiB", slab_size="16MiB", env={"KVSTORE_CREDENTIALS_FILE": str(creds)}
    ) as c:
        pid = c.nodes[0].process.pid
        with (
            KVCacheClient(c.redis_url, ns, auth_token_file=str(token["old"]), timeout=3) as old,
            KVCacheClient(c.redis_url, ns, auth_token_file=str(new_token["new"]), timeout=3) as new,
        ):
            assert stores(old, 0) and not stores(new, 1000)
            replace(creds.read_text() + new_line)
            attempt = iter(range(2000, 10**6, 1000))
            wait_for(lambda: stores(new, next(attempt)), 15, "the new credential to be accepted")
            replace(new_line)
            wait_for(
                lambda: not stores(old, next(attempt)), 15, "the removed credential to be refused"
            )
            replace("this line is not a credential\n")
            time.sleep(2.5)  # past the node's recheck
            assert stores(new, next(attempt)) and not stores(old, next(attempt))
        assert "not reloaded" in c.nodes[0].log()
        assert c.nodes[0].process.poll() is None and c.nodes[0].process.pid == pid


@pytest.mark.process
def test_a_node_without_any_credential_refuses_to_start(tmp_path):
    """Finding 1: with no token, no credential at all was needed. A node now needs a
    token, a credentials file, or an explicit --anonymous."""
    out = subprocess.run(
        [sys.executable, "-m", "server", "--metrics-port", "0"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        out.returncode == 2 and "--credentials-file" in out.stderr and "--anonymous" in out.stderr
    )
    (tmp_path / "bad").write_text("alice sha256:abc readwrite team-a\n")
    out = subprocess.run(
        [sys.executable, "-m", "server", "--credentials-file", str(tmp_path / "bad")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "line 1" in out.stderr and "64 lowercase hex" in out.stderr


# ---- index roles ---------------------------------------------------------------------


def acl_rules(role: str, tenant: str | None = None) -> list[str]:
    """The rules ``kvstore acl`` prints for a role (a real process)."""
    out = subprocess.run(
        [*KVSTORE, "acl", "--role", role, *(["--tenant", tenant] if tenant else [])],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.split()


def test_the_documented_acl_rules_are_the_ones_kvstore_acl_prints():
    from kvstore.security import acl

    doc = (ROOT / "docs" / "security.md").read_text()
    for role, tenant in (("node", None), ("client", "team-a"), ("operator", None)):
        assert f"{role + ':':<10}{acl.rules(role, tenant)}\n" in doc


@pytest.mark.process
def test_index_roles_confine_tenants_and_keep_clients_from_registering_nodes():
    """Findings 2 and 3: every client held index credentials that listed every tenant's
    page hashes (SCAN) and could register a node, which then received pages and tokens.
    With the roles of `kvstore acl`, nodes, clients of two tenants and an operator each
    work end to end, and each attack below is refused by Valkey itself."""
    from kvstore.tools.launcher import LocalCluster

    ns_a, ns_b = make_ns("team-a"), make_ns("team-b")
    tokens = list(range(4 * ns_a.block_size))
    with EmbeddedValkey() as valkey:
        admin = redis.Redis.from_url(valkey.url)
        users = {
            "node": ("node", None),
            "alice": ("client", "team-a"),
            "bob": ("client", "team-b"),
            "ops": ("operator", None),
            "carol": ("client", "team-a"),  # made before the client role ran MGET
        }
        for user, (role, tenant) in users.items():
            rules = [r for r in acl_rules(role, tenant) if user != "carol" or r != "+mget"]
            admin.execute_command("ACL", "SETUSER", user, "on", f">pw-{user}", *rules)
        admin.execute_command("ACL", "SETUSER", "default", "off")
        where = valkey.url.split("//", 1)[1]
        url = {user: f"redis://{user}:pw-{user}@{where}" for user in users}
        with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB", redis_url=url["node"]):
            for user, ns in (("alice", ns_a), ("bob", ns_b)):
                with KVCacheClient(url[user], ns) as client:
                    assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 4
                    out = torch.zeros_like(pages_for(ns, tokens))
                    assert client.get_pages(tokens, out) == len(tokens) and torch.equal(
                        as_bytes(out), as_bytes(pages_for(ns, tokens))
                    )
                    assert client.stats.index_errors == 0 and client.stats.index_script_errors == 0
            # keyed pages (SGLang's) asked without a lease are one MGET, which the role
            # allows; a user of the older rules is answered through the script instead
            keyed = ns_a.model_copy(update={"layout": "sglang_2blhd", "block_size": 4})
            page_keys = [f"key-{i}" for i in range(3)]
            flat = host_bytes(torch.arange(3 * keyed.page_nbytes // 2, dtype=torch.int16))
            spans = [Span(flat, i * keyed.page_nbytes, keyed.page_nbytes) for i in range(3)]
            for user in ("alice", "carol"):
                with KVCacheClient(url[user], keyed) as client:
                    client.put_keyed(page_keys[:2], spans[:2])
                    assert client.find_keys(page_keys, lease=False).blocks == 2, user
                    assert client.stored_keys(page_keys) == [True, True, False], user
                    assert client.stats.index_script_errors == 0, user
                    mget_refused = client._index(None).mget_refused
                    assert mget_refused == (user == "carol"), user

            alice = redis.Redis.from_url(url["alice"])
            listed = {m.decode() for m in admin.smembers("kvs:{registry}:namespaces")}
            assert listed == {
                ns_a.key.member,
                ns_b.key.member,
                keyed.key.member,
            }  # by the node, which may write the registry
            for attack in (
                lambda: alice.scan(0),
                lambda: alice.keys("*"),
                lambda: alice.randomkey(),
                lambda: alice.hget(ns_b.key.meta, "json"),
                lambda: alice.hset("kvs:{registry}:node:rogue", "address", "10.0.0.66:1"),
                lambda: alice.zadd("kvs:{registry}:nodes", {"rogue": 2**50}),
                lambda: alice.flushall(),
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    attack()
            with KVCacheClient(
                url["alice"], ns_b, timeout=3
            ) as spy:  # alice with bob's namespace: no entry is readable
                assert spy.lookup(tokens) == 0
            rogue = PageIndex(url["alice"])
            with pytest.raises(Exception, match="(?i)permission"):
                rogue.register_node("rogue", "10.0.0.66:1", 1 << 30, 5000)
            assert [n.node_id for n in rogue.live_nodes()] == [
                "node-0"
            ]  # clients still read the registry

            out = subprocess.run(
                [*KVSTORE, "stats", "--redis-url", url["ops"]],
                env=ENV,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert (
                out.returncode == 0
                and "node-0" in out.stdout
                and "team-a" in out.stdout
                and "team-b" in out.stdout
            )
            ops = redis.Redis.from_url(url["ops"])
            with pytest.raises(redis.exceptions.NoPermissionError):
                ops.set(ns_a.key.meta, "x")
        denied = {str(entry["username"]) for entry in admin.acl_log(100)}
        assert denied == {
            "alice",
            "carol",
            "ops",
        }  # Valkey logged the refusals (carol's MGET once); the node and bob were never refused


# ---- limits ----------------------------------------------------------------------------


@pytest.mark.process
def test_one_tenant_cannot_flush_another_tenants_pages():
    """Finding 4: one large put evicted every page of the node. Now a put reserves at most
    --max-request-bytes, and a tenant past --tenant-quota evicts only its own pages; a
    request naming more than --max-request-pages pages is refused whole."""
    from kvstore.tools.launcher import LocalCluster
    from tests.support.helpers import metrics

    bob_ns, mallory_ns = (
        namespace_for_page_size(64 << 10, tenant="bob"),
        namespace_for_page_size(64 << 10, tenant="mallory"),
    )
    bob_tokens = list(range(128 * bob_ns.block_size))  # 8 MiB
    args = ["--tenant-quota", "0.5", "--max-request-bytes", "16MiB", "--max-request-pages", "2048"]
    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB", extra_args=args) as c:
        with KVCacheClient(c.redis_url, bob_ns) as bob:
            assert bob.put_pages(bob_tokens, pages_for(bob_ns, bob_tokens)).stored == 128
        with KVCacheClient(c.redis_url, mallory_ns, timeout=10) as mallory:
            for round_ in range(4):  # 4 x 1,000 pages of 64 KiB: each put offers 62.5 MiB
                tokens = list(range(round_ * 10**6, round_ * 10**6 + 1000 * mallory_ns.block_size))
                report = mallory.put_pages(tokens, pages_for(mallory_ns, tokens))
                assert 0 < report.stored <= 256, report  # 16 MiB of 64 KiB pages at most
            huge = list(range(2049 * mallory_ns.block_size))
            errors = mallory.stats.node_errors
            assert mallory.put_pages(huge, pages_for(mallory_ns, huge)).stored == 0
            assert mallory.stats.node_errors == errors + 1
        held = metrics(c, "node-0")
        assert (
            held["kvstore_used_bytes"] <= 8 * 2**20 + 32 * 2**20
        )  # bob's pages and mallory's quota
        assert held['kvstore_errors_total{kind="too_large"}'] == 1
        with KVCacheClient(c.redis_url, bob_ns) as bob:
            out = torch.zeros_like(pages_for(bob_ns, bob_tokens))
            assert bob.get_pages(bob_tokens, out) == len(bob_tokens)
            assert torch.equal(as_bytes(out), as_bytes(pages_for(bob_ns, bob_tokens)))
