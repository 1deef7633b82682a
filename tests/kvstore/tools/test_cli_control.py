"""``kvstore pin|unpin|prefetch|clear|where`` (kvstore/tools/cli_control.py): the
options make the body the API takes, a mistake is one line naming the option and exit
2, and on a real store (Valkey and node processes) the commands act on every node and
print a line per node and a total, or a table, or JSON."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from client import KVCacheClient
from kvstore import block_hashes
from kvstore.control.requests import ClearRequest, PinRequest, PrefixRequest
from kvstore.errors import InvalidInputError
from kvstore.tools.cli_control import control_body, parse_tokens
from kvstore.tools.cli_errors import EXIT_FAILED, EXIT_USAGE
from tests.support.helpers import KVSTORE_CLI, cli_env, namespace_for_page_size, pages_for

HASH = "0123456789abcdef0123456789abcdef"


def args(command: str, **given) -> argparse.Namespace:
    fields = dict.fromkeys(
        (
            "model",
            "tokens",
            "block_hashes",
            "namespace",
            "lora",
            "salt",
            "block_size",
            "tenant",
            "ttl",
        )
    )
    return argparse.Namespace(command=command, **{**fields, **given})


def test_options_make_the_body():
    pin = control_body(args("pin", model="m", tokens="1, 2 3,4", ttl=30.0, lora="l", salt="s"))
    assert isinstance(pin, PinRequest)
    assert (pin.token_ids, pin.ttl_s, pin.lora_name, pin.cache_salt, pin.tenant) == (
        [1, 2, 3, 4],
        30.0,
        "l",
        "s",
        "default",
    )
    unpin = control_body(args("unpin", block_hashes=f"{HASH},{HASH}", namespace=HASH, tenant="t"))
    assert type(unpin) is PrefixRequest and unpin.block_hashes == [HASH, HASH]
    clear = control_body(args("clear", tenant="t", model="m"))
    assert isinstance(clear, ClearRequest) and not clear.has_prefix


def test_tokens_come_from_a_file(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps([5, 6, 7]))
    assert parse_tokens(f"@{path}") == [5, 6, 7]
    path.write_text('{"tokens": [1]}')
    with pytest.raises(InvalidInputError, match="must hold a JSON list of integers"):
        parse_tokens(f"@{path}")
    path.write_text("[1,")
    with pytest.raises(InvalidInputError, match="is not JSON"):
        parse_tokens(f"@{path}")
    with pytest.raises(InvalidInputError, match="cannot read"):
        parse_tokens(f"@{tmp_path / 'none.json'}")


@pytest.mark.parametrize(
    ("command", "given", "words"),
    [
        ("clear", {"model": "m"}, "clear needs --tenant given outright"),
        ("pin", {"model": "m", "tokens": "1,x"}, "--tokens: 'x' is not an integer token id"),
        ("pin", {"model": "m", "tokens": "1", "ttl": 0.0}, "--ttl: Input should be greater than 0"),
        ("pin", {"tokens": "1,2"}, "token_ids need model"),
        ("unpin", {"model": "m"}, "give the prefix"),
        ("where", {"block_hashes": "abc", "namespace": HASH}, "block_hashes are 32"),
        ("where", {"block_hashes": HASH, "namespace": "zz"}, "--namespace: String should match"),
        ("prefetch", {"model": "m", "tokens": "1", "block_size": 0}, "--block-size: "),
        ("pin", {"model": "m", "tokens": "1", "tenant": "a b"}, "--tenant: String should match"),
        ("unpin", {"model": "m", "tokens": "1", "lora": ""}, "--lora: "),
    ],
)
def test_a_mistake_names_the_option(command, given, words):
    with pytest.raises(InvalidInputError) as exc:
        control_body(args(command, **given))
    assert words in str(exc.value) and "\n" not in str(exc.value)


def kvstore(*argv: str, url: str) -> subprocess.CompletedProcess:
    env = {**cli_env(), "KVSTORE_REDIS_URL": url}
    return subprocess.run(
        [*KVSTORE_CLI, *argv], env=env, capture_output=True, text=True, timeout=120
    )


def test_the_commands_act_on_every_node_and_say_what_they_did(clusters, tmp_path):
    cluster = clusters(servers=2, capacity="64MiB", slab="16MiB")
    ns = namespace_for_page_size(64 << 10, tenant="cli-control")
    tokens = list(range(1000, 1000 + 3 * ns.block_size))
    with KVCacheClient(cluster.redis_url, ns, replicas=2, lease_ms=0) as client:
        assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 3
        listed = ",".join(map(str, tokens))
        scope = ("--model", ns.model, "--tenant", ns.tenant)
        url = cluster.redis_url

        out = kvstore("pin", *scope, "--tokens", listed, "--ttl", "300", url=url)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert len(lines) == 3 and lines[0].startswith("node-0") and lines[1].startswith("node-1")
        assert "pinned 3 page(s)" in lines[0] and "3 whole block(s)" in lines[0]
        assert lines[2].startswith("total") and "pinned 6 page(s)" in lines[2]
        assert "on 2 of 2 node(s)" in lines[2]

        token_file = tmp_path / "tokens.json"
        token_file.write_text(json.dumps(tokens))
        out = kvstore("where", *scope, "--tokens", f"@{token_file}", url=url)
        assert out.returncode == 0, out.stderr
        text = out.stdout.splitlines()
        assert text[0] == f"namespace {ns.storage.digest_hex}: 3 block(s) of the prefix stored"
        rows = {line.split()[0]: line.split()[1:] for line in text[2:]}
        assert rows["node-0"][:3] == rows["node-1"][:3] == ["3", "0", "3"]
        assert 250 < float(rows["node-0"][3]) <= 300 and rows["node-0"][4] == "s"

        hashes = ",".join(h.hex() for h in block_hashes(ns.storage, tokens))
        by_hash = ("--block-hashes", hashes, "--namespace", ns.storage.digest_hex)
        out = kvstore("unpin", *by_hash, "--tenant", ns.tenant, "--json", url=url)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert (doc["action"], doc["pages"], doc["unreachable"]) == ("unpin", 6, {})
        assert [n["node_id"] for n in doc["nodes"]] == ["node-0", "node-1"]
        out = kvstore("where", *by_hash, "--tenant", ns.tenant, "--json", url=url)
        doc = json.loads(out.stdout)
        assert [r["pinned"] for r in doc["summary"]] == [0, 0]
        assert doc["holders"][ns.storage.digest_hex]["2"][1]["node_id"] == "node-1"

        out = kvstore("clear", "--model", ns.model, url=url)  # no --tenant: refused
        assert out.returncode == EXIT_USAGE and out.stdout == ""
        assert (
            out.stderr
            == "kvstore clear: clear needs --tenant given outright (a guard: it drops pages)\n"
        )
        out = kvstore("clear", *scope, url=url)  # the model's pages of the tenant
        assert out.returncode == 0 and "cleared 6 page(s)" in out.stdout.splitlines()[-1]
        assert client.lookup(tokens) == 0

        cluster.nodes[1].kill()
        cluster.nodes[1].process.wait(10)
        out = kvstore("prefetch", *scope, "--tokens", listed, url=url)
        assert out.returncode == EXIT_FAILED, out.stderr
        assert any(
            line.startswith("node-1") and "unreachable" in line for line in out.stdout.splitlines()
        )
