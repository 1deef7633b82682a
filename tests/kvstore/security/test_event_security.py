"""Attacks on a storage node's KV event stream (issue 56; docs/security.md, "KV event
stream"), with real processes: a node that checks tokens, events on, two tenants
writing pages of the same model. Every subscriber below is a plain ZeroMQ socket, as
a router or an attacker would open one."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from client import KVCacheClient
from kvstore import block_hashes
from kvstore.events import END_SEQ, decoder, tenant_prefix
from kvstore.events.access import curve_client
from kvstore.security.routers import new_key_files
from kvstore.tools.launcher import LocalCluster
from kvstore.tools.procutil import free_port
from tests.support.helpers import cli_env, metrics, namespace_for_page_size, pages_for, wait_for
from tests.support.security import run_kvstore, tenant_credentials

ENV = cli_env()  # no token: each test hands its processes the one it means
STORE = "node-0"


class Keys:
    """Key pairs made by ``kvstore events-key`` (real processes): the node's, routers
    reading team-a, team-b or every tenant, and an outsider's the routers file omits."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "keys"
        self.node_public = run_kvstore("events-key", "node", "--out", str(self.dir))
        self.lines = {
            "router-a": run_kvstore(
                "events-key",
                "router",
                "--name",
                "router-a",
                "--tenant",
                "team-a",
                "--out",
                str(self.dir),
            ),
            "router-b": run_kvstore(
                "events-key",
                "router",
                "--name",
                "router-b",
                "--tenant",
                "team-b",
                "--out",
                str(self.dir),
            ),
        }
        new_key_files(str(self.dir), "outsider")
        self.routers = tmp_path / "routers"
        self.write(self.lines.values())

    def file(self, name: str) -> str:
        return str(self.dir / f"{name}.key_secret")

    def write(self, lines) -> None:
        """Replace the routers file as a Kubernetes Secret update does: a new file renamed over."""
        tmp = self.routers.with_suffix(".new")
        tmp.write_text("".join(f"{line}\n" for line in lines))
        os.replace(tmp, self.routers)

    def node_args(self, pub: int, rep: int) -> list[str]:
        return [
            "--kv-events-endpoint",
            f"tcp://*:{pub}",
            "--kv-events-replay-endpoint",
            f"tcp://*:{rep}",
            "--kv-events-routers-file",
            str(self.routers),
            "--kv-events-key-file",
            self.file("node"),
        ]


class Subscriber:
    """A SUB socket read by a thread: every (topic, sequence, payload) it receives.
    ``key``: a router's key file (CURVE); None: no credential at all."""

    def __init__(self, port: int, keys: Keys, key: str | None, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        if key is not None:
            curve_client(self.sock, keys.node_public, keys.file(key))
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.got: list[tuple[bytes, int, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                self.got.append((topic, int.from_bytes(seq, "big"), payload))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


def replay_as(
    port: int, keys: Keys, key: str | None, timeout: float = 3.0
) -> list[tuple[bytes, int, bytes]] | None:
    """What vLLM's replay protocol hands ``key`` from sequence 0; None when nothing
    came back within ``timeout`` (the handshake was refused)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if key is not None:
        curve_client(sock, keys.node_public, keys.file(key))
    sock.connect(f"tcp://127.0.0.1:{port}")
    out = []
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            if not sock.poll(int(timeout * 1000)):
                return None
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)
        ctx.term()


def blocks_in(messages) -> tuple[set[bytes], list[int]]:
    """The block hashes and token ids of every event in ``messages``."""
    hashes: set[bytes] = set()
    tokens: list[int] = []
    for _, _, payload in messages:
        for e in decoder().decode(payload).events:
            hashes.update(getattr(e, "block_hashes", []))
            tokens.extend(getattr(e, "token_ids", []))
    return hashes, tokens


@pytest.mark.process
def test_routers_read_only_their_tenants_and_strangers_read_nothing(tmp_path):
    """Before: a plain SUB socket with no credential read all 64 token ids of every
    tenant's put. Now an unauthenticated subscriber and an unlisted key get nothing on
    either socket; a router of team-b never sees team-a's topics, block hashes or token
    ids (not even by subscribing to team-a's topic); the router of team-a sees every
    block team-a stored, with its token ids, decoded with vLLM's own types; team-b's
    blocks carry hashes only (token ids are opt-in per tenant). Each refusal is counted."""
    keys = Keys(tmp_path)
    creds, token = tenant_credentials(tmp_path)
    pub, rep = free_port(), free_port()
    ns_a = namespace_for_page_size(64 << 10, tenant="team-a")
    ns_b = namespace_for_page_size(64 << 10, tenant="team-b")
    assert ns_a.model == ns_b.model  # two tenants serving the same model
    tokens_a = list(range(100, 100 + 4 * ns_a.block_size))
    tokens_b = list(range(900, 900 + 4 * ns_b.block_size))
    args = [*keys.node_args(pub, rep), "--kv-events-token-ids", "team-a"]
    with LocalCluster(
        servers=1,
        capacity="64MiB",
        slab_size="16MiB",
        env={"KVSTORE_CREDENTIALS_FILE": str(creds)},
        extra_args=args,
    ) as c:
        subs = {
            "anonymous": Subscriber(pub, keys, None),
            "outsider": Subscriber(pub, keys, "outsider"),
            "router-b": Subscriber(pub, keys, "router-b"),
            "router-b asking team-a": Subscriber(
                pub, keys, "router-b", tenant_prefix(STORE, "team-a").encode()
            ),
            "router-a": Subscriber(pub, keys, "router-a"),
        }
        try:
            with (
                KVCacheClient(c.redis_url, ns_a, auth_token_file=str(token["alice"])) as alice,
                KVCacheClient(c.redis_url, ns_b, auth_token_file=str(token["bob"])) as bob,
            ):
                # ZMQ's slow joiner: warm up until both routers receive, then the real puts
                warm = iter(range(10_000, 10**9, 1000))

                def joined() -> bool:
                    n = next(warm)
                    alice.put_pages(
                        list(range(n, n + ns_a.block_size)),
                        pages_for(ns_a, list(range(n, n + ns_a.block_size))),
                    )
                    bob.put_pages(
                        list(range(n, n + ns_b.block_size)),
                        pages_for(ns_b, list(range(n, n + ns_b.block_size))),
                    )
                    time.sleep(0.2)
                    return bool(subs["router-a"].got) and bool(subs["router-b"].got)

                wait_for(joined, 30, "both routers to receive events")
                assert alice.put_pages(tokens_a, pages_for(ns_a, tokens_a)).stored == 4
                assert bob.put_pages(tokens_b, pages_for(ns_b, tokens_b)).stored == 4
            hashes_a, hashes_b = (
                set(block_hashes(ns_a, tokens_a)),
                set(block_hashes(ns_b, tokens_b)),
            )
            wait_for(
                lambda: hashes_a <= blocks_in(subs["router-a"].got)[0],
                10,
                "router-a to see team-a's put",
            )
            wait_for(
                lambda: hashes_b <= blocks_in(subs["router-b"].got)[0],
                10,
                "router-b to see team-b's put",
            )
            time.sleep(0.5)  # what else may come, comes now
        finally:
            for s in subs.values():
                s.close()
        a_prefix = tenant_prefix(STORE, "team-a").encode()
        assert subs["anonymous"].got == [] and subs["outsider"].got == []
        assert subs["router-b asking team-a"].got == []
        for name in ("router-b", "router-b asking team-a"):
            got = subs[name].got
            assert all(t.startswith(tenant_prefix(STORE, "team-b").encode()) for t, _, _ in got), (
                name
            )
            hashes, ids = blocks_in(got)
            assert not hashes & hashes_a and not set(ids) & set(tokens_a)
        assert blocks_in(subs["router-b"].got)[1] == []  # team-b did not opt in: hashes only
        # router-a: every team-a block, with its tokens, in vLLM's own types where vLLM is installed
        mine = subs["router-a"].got
        assert mine and all(t.startswith(a_prefix) for t, _, _ in mine)
        check_with_vllm(mine, ns_a, tokens_a)

        # the replay socket obeys the same rules
        assert replay_as(rep, keys, None) is None and replay_as(rep, keys, "outsider") is None
        replay_b = replay_as(rep, keys, "router-b")
        replay_a = replay_as(rep, keys, "router-a")
        assert replay_b and all(not t.startswith(a_prefix) for t, _, _ in replay_b)
        assert not blocks_in(replay_b)[0] & hashes_a
        assert replay_a and all(t.startswith(a_prefix) for t, _, _ in replay_a)
        assert hashes_a <= blocks_in(replay_a)[0] and not blocks_in(replay_a)[0] & hashes_b

        m = metrics(c, STORE)
        assert (
            m['kvstore_events_refused_total{reason="handshake"}'] >= 2
        )  # the anonymous SUB and DEALER
        assert m['kvstore_events_refused_total{reason="key"}'] >= 2  # the outsider's SUB and DEALER
        assert (
            m['kvstore_events_refused_total{reason="subscription"}'] >= 1
        )  # router-b asking for team-a


def check_with_vllm(messages, ns, tokens) -> None:
    """Decode ``messages`` with vLLM's ``KVEventBatch`` (skipped without vLLM: ours
    decoded them above) and check the put's blocks are there with their token ids."""
    try:
        from vllm.distributed.kv_events import BlockStored, KVEventBatch
    except ImportError:
        return
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    want = block_hashes(ns, tokens)
    seen = {}
    for _, _, payload in messages:
        for e in dec.decode(payload).events:
            if isinstance(e, BlockStored):
                for i, h in enumerate(e.block_hashes):
                    seen[h] = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
    assert [seen.get(h) for h in want] == [
        tokens[i * ns.block_size : (i + 1) * ns.block_size] for i in range(len(want))
    ]


@pytest.mark.process
def test_a_routers_key_rotates_and_a_removed_key_is_cut_off_without_a_restart(tmp_path):
    """An operator rotates router-a's key: adds the new key's line, moves the router,
    removes the old line. The new key reads at once; once the old line is gone the node
    binds its sockets again, so the old key's open connection stops receiving and its
    reconnect is refused. The node never restarts."""
    keys = Keys(tmp_path)
    pub, rep = free_port(), free_port()
    ns = namespace_for_page_size(64 << 10, tenant="team-a")
    with LocalCluster(
        servers=1, capacity="64MiB", slab_size="16MiB", extra_args=keys.node_args(pub, rep)
    ) as c:
        node_pid = c.nodes[0].process.pid
        old = Subscriber(pub, keys, "router-a")
        new_line = run_kvstore(
            "events-key",
            "router",
            "--name",
            "router-a2",
            "--tenant",
            "team-a",
            "--out",
            str(keys.dir),
        )
        keys.write([*keys.lines.values(), new_line])
        new = Subscriber(pub, keys, "router-a2")
        counter = iter(range(0, 10**9, 1000))

        def put_reaches(*subs: Subscriber) -> bool:
            before = [len(s.got) for s in subs]
            n = next(counter)
            with KVCacheClient(c.redis_url, ns) as client:
                client.put_pages(
                    list(range(n, n + ns.block_size)),
                    pages_for(ns, list(range(n, n + ns.block_size))),
                )
            time.sleep(0.3)
            return all(len(s.got) > b for s, b in zip(subs, before, strict=True))

        try:
            wait_for(lambda: put_reaches(old, new), 30, "both keys to receive")
            keys.write([keys.lines["router-b"], new_line])  # the old key's line removed
            wait_for(
                lambda: metrics(c, STORE)["kvstore_events_rebinds_total"] == 1,
                10,
                "the node to bind again",
            )
            wait_for(lambda: put_reaches(new), 30, "the new key to receive after the rebind")
            cut = len(old.got)
            for _ in range(3):
                put_reaches(new)
            assert len(old.got) == cut, "the removed key still receives"
            assert metrics(c, STORE)['kvstore_events_refused_total{reason="key"}'] >= 1
        finally:
            old.close()
            new.close()
        assert c.nodes[0].process.pid == node_pid and c.nodes[0].process.poll() is None
