"""What the tests of the operator control API (issue 73: server/control/) share: its
requests sent by hand to one node's metrics port (``POST /v1/kv/pin|unpin|prefetch|
clear``, and ``/v1/kv/query`` with ``residency``), a node's table read back through
them, and floods of other prompts that push a node's pages out of memory.

No control client here: a request goes to one node, as a caller sends it to each
(kvstore.control.requests), so a test sees each node's own answer."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import torch

from kvstore import Namespace, block_hashes
from kvstore.index import PageIndex
from tests.support.helpers import as_bytes, pages_for

PAGE = 64 << 10  # 64 KiB pages, 16 tokens a block (namespace_for_page_size)


def metrics_address(cluster, node_id: str = "node-0") -> str:
    """A node's metrics port (its registry entry's ``extra["metrics"]``): the control API's."""
    index = PageIndex(cluster.redis_url)
    try:
        return next(n for n in index.live_nodes() if n.node_id == node_id).extra["metrics"]
    finally:
        index.close()


def post(address: str, path: str, body: dict, token: str | None = None) -> tuple[int, dict]:
    return post_raw(address, path, json.dumps(body).encode(), token)


def post_raw(address: str, path: str, body: bytes, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://{address}{path}", body, headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def by_tokens(ns: Namespace, tokens: list[int], **more) -> dict:
    """A control body naming ``tokens`` of ``ns``'s model and tenant (the token form)."""
    return {"tenant": ns.tenant, "model": ns.model, "token_ids": list(tokens), **more}


def by_hashes(ns: Namespace, tokens: list[int], **more) -> dict:
    """A control body naming the blocks of ``tokens`` by the store's hashes (the hash
    form), in ``ns``'s storage namespace."""
    return {
        "tenant": ns.tenant,
        "namespace": ns.storage.digest_hex,
        "block_hashes": [h.hex() for h in block_hashes(ns.storage, tokens)],
        **more,
    }


def act(address: str, action: str, body: dict, token: str | None = None, status: int = 200) -> dict:
    """``POST /v1/kv/<action>``; asserts the answer's status and returns its body."""
    got, answer = post(address, f"/v1/kv/{action}", body, token)
    assert got == status, (action, got, answer)
    return answer


def residency(address: str, ns: Namespace, tokens: list[int], token: str | None = None) -> list:
    """The blocks of ``tokens`` the node at ``address`` holds, as its ``/v1/kv/query``
    with ``residency`` answers them for ``ns``'s namespace: one dict per block held
    whole (``block``, ``tier``, ``pinned``, ``pin_ttl_s``)."""
    status, got = post(address, "/v1/kv/query", {**by_tokens(ns, tokens), "residency": True}, token)
    assert status == 200, got
    mine = [a for a in got["namespaces"] if a["namespace"] == ns.storage.digest_hex]
    return mine[0].get("residency", []) if mine else []


def query_tiers(address: str, ns: Namespace, tokens: list[int]) -> dict:
    """The answering node's tiers of ``tokens`` (``/v1/kv/query``): {"CPU": n, "DISK": m},
    or zeros when it holds none of them."""
    status, got = post(address, "/v1/kv/query", by_tokens(ns, tokens))
    assert status == 200, got
    for answer in got["namespaces"]:
        if answer["namespace"] == ns.storage.digest_hex:
            for node in answer["nodes"]:
                if "tiers" in node:
                    return node["tiers"]
    return {"CPU": 0, "DISK": 0}


def prompt(ns: Namespace, seed: int, blocks: int) -> list[int]:
    """A prompt of ``blocks`` full blocks whose tokens no other seed's share."""
    start = 1_000_000 + seed * 10_000
    return list(range(start, start + blocks * ns.block_size))


def flood(client, ns: Namespace, nbytes: int, seed: int = 1000, blocks: int = 64) -> int:
    """Put other prompts of ``ns`` worth ``nbytes`` through ``client``, ``blocks`` a put;
    returns the pages stored."""
    stored = 0
    for i in range(max(1, nbytes // (blocks * ns.page_nbytes))):
        tokens = prompt(ns, seed + i, blocks)
        stored += client.put_pages(tokens, pages_for(ns, tokens)).stored
    return stored


def read_exact(client, ns: Namespace, tokens: list[int]) -> int:
    """Blocks of ``tokens`` a get reads; each read page must be the bytes that were put."""
    want = pages_for(ns, tokens)
    out = torch.zeros_like(want)
    got = client.get_pages(tokens, out) // ns.block_size
    assert torch.equal(as_bytes(out[:got]), as_bytes(want[:got])), "a page read back was wrong"
    return got


def node_metric(cluster, node_id: str, name: str) -> float:
    """One of a node's metrics (0 when the node has not set it)."""
    from tests.support.helpers import metrics

    return metrics(cluster, node_id).get(name, 0.0)
