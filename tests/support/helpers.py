"""Deterministic test data, node and index helpers; worker processes are
tests/support/worker_process.py's (named here too, for the tests that import them from here).

Page bytes are a pure function of the page's block hash, so any process can rebuild
what a page must contain and compare bit for bit."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from client.codec import pages_into_kv
from kvstore import Namespace, block_hashes
from kvstore.events.access import curve_client
from kvstore.index import PageIndex
from kvstore.security.routers import new_key_files
from kvstore.tools.launcher import LocalCluster
from kvstore.wire import protocol
from tests.support.paths import ROOT
from tests.support.worker_process import WorkerProcess as WorkerProcess
from tests.support.worker_process import run_worker as run_worker
from tests.support.worker_process import worker_result as worker_result


def pages_to_kv(pages: torch.Tensor, extra_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[blocks, 2, L, B, H, D]`` pages -> key, value ``[L, blocks*B + extra_tokens, H, D]``
    (``codec.pages_into_kv``); the last ``extra_tokens`` rows are left unset."""
    n, _, L, B, H, D = pages.shape
    kv = torch.empty(2, L, n * B + extra_tokens, H, D, dtype=pages.dtype)
    pages_into_kv(pages, kv)
    return kv[0], kv[1]


def namespace_for_page_size(nbytes: int, tenant: str = "default", **fields) -> Namespace:
    """A kv_lbhd float16 namespace whose pages are ``nbytes`` long (power of two >= 4 KiB)."""
    head, heads, layers = 32, 1, 1
    block = nbytes // (2 * layers * heads * head * 2)
    while block > 64:
        if layers < 32:
            layers *= 2
        elif heads < 8:
            heads *= 2
        else:
            head *= 2
        block = nbytes // (2 * layers * heads * head * 2)
    ns = Namespace(
        model="page-size-test",
        dtype="float16",
        num_layers=layers,
        num_kv_heads=heads,
        head_size=head,
        block_size=block,
        tenant=tenant,
        **fields,
    )
    assert ns.page_nbytes == nbytes, (ns, nbytes)
    return ns


def page_bytes(ns: Namespace, block_hash: bytes) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(block_hash[:8], "little"))
    return rng.integers(0, 256, ns.page_nbytes, dtype=np.uint8)


def tenant_for(test_name: str) -> str:
    """A tenant name unique to a test: tenant names are at most 64 of [A-Za-z0-9_.-],
    and a digest keeps long parametrized names apart."""
    return (
        re.sub(r"[^A-Za-z0-9_.-]", "_", test_name)[:52]
        + "-"
        + hashlib.sha1(test_name.encode()).hexdigest()[:8]
    )


def pages_for(ns: Namespace, tokens) -> torch.Tensor:
    """``[blocks, *page_shape]`` whose bytes depend only on each block's hash."""
    hashes = block_hashes(ns, tokens)
    flat = np.concatenate([page_bytes(ns, h) for h in hashes]) if hashes else np.zeros(0, np.uint8)
    return torch.from_numpy(flat).view(ns.torch_dtype()).reshape(len(hashes), *ns.page_shape)


def kv_for(ns: Namespace, tokens, seed: int = 0):
    """key, value ``[layers, tokens, heads, head]`` and hidden ``[tokens, hidden]``; the KV of a
    full block depends only on the prefix up to that block (like a real model's)."""
    n = len(tokens)
    full = (n // ns.block_size) * ns.block_size
    gen_ns = ns.model_copy(update={"layout": "kv_lbhd"})
    key, value = (
        pages_to_kv(pages_for(gen_ns, tokens[:full]))
        if full
        else (torch.zeros(ns.num_layers, 0, ns.num_kv_heads, ns.head_size, dtype=ns.torch_dtype()),)
        * 2
    )
    g = torch.Generator().manual_seed(seed + n)
    tail_k = torch.randn(ns.num_layers, n - full, ns.num_kv_heads, ns.head_size, generator=g).to(
        ns.torch_dtype()
    )
    tail_v = torch.randn(ns.num_layers, n - full, ns.num_kv_heads, ns.head_size, generator=g).to(
        ns.torch_dtype()
    )
    hidden = torch.randn(n, max(ns.hidden_size, 1), generator=g).to(ns.torch_dtype())[
        :, : ns.hidden_size
    ]
    return torch.cat([key, tail_k], 1), torch.cat([value, tail_v], 1), hidden


def rank_pages(ns: Namespace, tokens) -> torch.Tensor:
    """This TP rank's slice of model pages that do not depend on the TP layout: the pages
    of all heads (``pages_for`` of the rank's storage namespace), narrowed to the rank's
    heads. Engines of any TP size see the same KV through it."""
    lo, hi = ns.head_range
    return pages_for(ns.storage, tokens).narrow(1 + ns.head_dim, lo, hi - lo).contiguous()


def rank_kv(ns: Namespace, tokens):
    """``kv_for`` of the whole model, narrowed to this rank's heads (key and value)."""
    lo, hi = ns.head_range
    key, value, hidden = kv_for(ns.storage, tokens)
    return key[:, :, lo:hi].contiguous(), value[:, :, lo:hi].contiguous(), hidden


def metrics(cluster, node_id: str) -> dict[str, float]:
    """A node's Prometheus metrics, found through its registry entry.

    Waits up to 15 s for the entry: after the index was unreachable for longer than the
    node TTL the entry has expired, and the node writes it again at its next heartbeat
    (a CI run once read the registry in between)."""
    index = PageIndex(cluster.redis_url)
    try:

        def entry():
            return next((n for n in index.live_nodes() if n.node_id == node_id), None)

        wait_for(lambda: entry() is not None, 15, f"{node_id}'s registry entry", 0.1)
        node = entry()
    finally:
        index.close()
    text = (
        urllib.request.urlopen(f"http://{node.extra['metrics']}/metrics", timeout=5).read().decode()
    )
    values = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def spec(cluster, ns, op, **kw):
    """A tests/support/worker.py spec against ``cluster``."""
    return {"op": op, "redis_url": cluster.redis_url, "namespace": ns.model_dump(), **kw}


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def raw_index(url: str):
    """Plain redis-py access to the index under test (a cluster client for a cluster URL)."""
    import redis

    from kvstore.index.routing import CLUSTER_SCHEMES, seed_urls

    if url.split("://", 1)[0] in CLUSTER_SCHEMES:
        return redis.RedisCluster.from_url(seed_urls(url)[0])
    return redis.Redis.from_url(url)


def corrupt_entry_checksums(url: str, ns: Namespace, hashes: list[bytes], i: int) -> int:
    """Flip a bit of the checksum in every index entry of page ``hashes[i]`` (a chain from
    block 0); returns how many entries changed."""
    from kvstore.index import ENTRY, HASH_PAIR
    from kvstore.pages import keys

    raw = raw_index(url)
    key = keys.segment_key(ns.key.prefix, keys.placement(hashes)[0][i])
    entries = np.frombuffer(raw.get(key), dtype=ENTRY).copy()
    want = np.frombuffer(hashes[i], dtype=HASH_PAIR)[0]
    hit = (entries["h0"] == want["h0"]) & (entries["h1"] == want["h1"])
    entries["checksum"][hit] ^= 1
    raw.set(key, entries.tobytes(), keepttl=True)
    raw.close()
    return int(hit.sum())


def advertised_prefix(index: PageIndex, ns: Namespace, hashes: list[bytes], **kw) -> int:
    """Leading pages of ``hashes`` the index advertises on a live node."""
    return index.lookup(ns, hashes, **kw).resolve(index.live_nodes()).matched


class RouterKeys:
    """A node key and one router reading every tenant, as an operator makes them with
    ``kvstore events-key`` (docs/security.md): a test reads a node's events as an
    authenticated router."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvstore-event-keys-")
        self.node_public, self.node_secret = new_key_files(self.dir, "node")
        router_public, self.router_secret = new_key_files(self.dir, "router")
        self.routers = os.path.join(self.dir, "routers")
        with open(self.routers, "w") as f:
            f.write(f"router {router_public} *\n")

    def node_args(self) -> list[str]:
        """The node options that turn authentication on."""
        return ["--kv-events-routers-file", self.routers, "--kv-events-key-file", self.node_secret]

    def client(self, sock) -> None:
        """Make a SUB or DEALER socket (before it connects) authenticate as the router."""
        curve_client(sock, self.node_public, self.router_secret)


# A test of storage nodes on a single Valkey and on a 3-shard Valkey cluster (the
# ``index_shards`` fixture of tests/conftest.py).
ON_BOTH_INDEXES = pytest.mark.parametrize("index_shards", [1, 3], ids=["valkey", "cluster3"])


def no_tracebacks(cluster: LocalCluster) -> None:
    """No traceback through this project's code in any node's log."""
    for node in cluster.nodes:
        assert not re.search(r'File "[^"]*/(?:server|kvstore|client)/', node.log()), node.log()[
            -3000:
        ]


def unix_reply(sock: socket.socket) -> Any:
    head = sock.recv(protocol.PREAMBLE.size, socket.MSG_WAITALL)
    if len(head) < protocol.PREAMBLE.size:
        raise ConnectionError(f"the node closed the socket ({len(head)} bytes of a reply)")
    return protocol.decode(head + sock.recv(protocol.announced_length(head), socket.MSG_WAITALL))


def shm_path(cluster: LocalCluster) -> str:
    index = PageIndex(cluster.redis_url)
    try:
        return index.live_nodes()[0].extra["shm"]
    finally:
        index.close()


# The kvstore command as a test runs it, and its environment without a token (the
# tests hand every process the credentials they mean it to have).
KVSTORE_CLI = [sys.executable, "-m", "kvstore.tools.cli"]


def cli_env() -> dict[str, str]:
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": str(ROOT)}
    for name in ("KVSTORE_AUTH_TOKEN", "KVSTORE_AUTH_TOKEN_FILE", "KVSTORE_CREDENTIALS_FILE"):
        env.pop(name, None)
    return env


def make_credentials(
    tmp_path: Path, *specs: tuple[str, str, list[str]]
) -> tuple[Path, dict[str, Path]]:
    """A credentials file with one line per ``(name, rights, tenants)``, each made by
    ``kvstore credential`` (a real process); returns it and each name's token file."""
    lines, tokens = [], {}
    for name, rights, tenants in specs:
        token_file = tmp_path / f"{name}.token"
        tenant_args = [a for t in tenants for a in ("--tenant", t)]
        argv = ["credential", "--name", name, "--rights", rights, *tenant_args]
        out = subprocess.run(
            [*KVSTORE_CLI, *argv, "--token-file", str(token_file)],
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        token = token_file.read_text().strip()
        assert len(token) >= 40 and token not in out.stdout + out.stderr
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        lines.append(out.stdout.strip())
        tokens[name] = token_file
    path = tmp_path / "credentials"
    path.write_text("\n".join(lines) + "\n")
    return path, tokens


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat."""
    return t.contiguous().view(-1).view(torch.uint8)
