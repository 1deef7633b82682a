"""Hosts of their own on one machine: Linux network namespaces joined by a router.

The fault tests (tests/faults/test_faults_network.py) give the index, each storage node and
the test's own clients an address of their own. Every packet between them crosses a
router namespace, so faults are injected per link there, where a real network has
them, and the endpoints see what they would see on a real one:

- ``partition(a, b)``: iptables DROP in the router, both ways. Packets vanish; no
  endpoint gets an error (a dead switch port, a cut cable), so TCP and UCX wait.
- ``lossy(a, b, p)``: the router drops each packet with probability ``p`` (iptables'
  ``statistic`` match), both ways.
- ``slow(host, delay_ms, jitter_ms)``: every packet to and from a host held for a delay
  with jitter by a relay in the router (tests/support/slow_link.py). The kernel's own
  netem would do it, but the 2-core VM these tests were written on has no ``sch_netem``
  ("Specified qdisc kind is unknown"), nor a tc classifier or action to steer a link
  into one, so the relay is the one way here, and works wherever TUN devices do.

The clients stay in the test's own namespace (they reach the others through a veth
and a route to this fixture's /24), so a client is a forked worker (tests/support/helpers.py
``run_worker``) or a thread of the test, with ``UCX_NET_DEVICES`` naming that veth.
Addresses come from 198.18.0.0/15 (RFC 2544's benchmarking block), one /24 per
fixture, a /30 per link, so concurrent tests and the machine's own networks never
overlap. Needs root, iproute2 and iptables; ``network_or_skip`` says which is missing.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from tests.support.paths import ROOT


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    subprocess.run(argv, check=True, capture_output=True, timeout=10)


def _in(netns: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", "netns", "exec", netns, *argv], check=True, capture_output=True, timeout=10
    )


def missing_tools() -> str | None:
    """Why namespaces with faulty links cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / iptables)"
    probe = f"kvprobe{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, timeout=10)
        _in(probe, "iptables", "-L", "FORWARD")
    except (subprocess.SubprocessError, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        return f"cannot make a network namespace with iptables here: {err.decode().strip() or exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def tun_missing() -> str | None:
    """Why the slow-link relay cannot run here (it needs /dev/net/tun), or None."""
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as exc:
        return f"/dev/net/tun cannot be opened ({exc.strerror})"
    return None


@dataclass
class Host:
    """One host: its namespace (None: the test's own), its address, its interface and
    the router's end of its link."""

    name: str
    netns: str | None
    address: str
    device: str
    link: str

    def argv(self, *argv: str) -> list[str]:
        """``argv`` run on this host (inside its namespace)."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)


@dataclass
class Network:
    """A router namespace and the hosts linked to it; ``close`` removes them all."""

    group: int
    router: str
    hosts: dict[str, Host] = field(default_factory=dict)
    _root_links: list[str] = field(default_factory=list)
    _relays: dict[str, subprocess.Popen] = field(default_factory=dict)

    @classmethod
    def make(cls) -> Network:
        """A router in a namespace of its own, on a /24 no other fixture holds."""
        for group in random.sample(range(256), 256):
            router = f"kvr{group}"
            made = subprocess.run(["ip", "netns", "add", router], capture_output=True, timeout=10)
            if made.returncode == 0:  # the name is the lock: another fixture holds it
                _ip("link", "set", "lo", "up", netns=router)
                _in(router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
                return cls(group, router)
        raise RuntimeError("no free 198.18.x.0/24 group for a test network")

    def _subnet(self, k: int) -> tuple[str, str]:
        """The router's and the host's address on link ``k`` (a /30)."""
        base = f"198.18.{self.group}."
        return base + str(4 * k + 1), base + str(4 * k + 2)

    def add_host(self, name: str, *, here: bool = False) -> Host:
        """A host linked to the router: in a namespace of its own, or (``here``) the
        test's own namespace, which then routes this network's /24 through the router."""
        k = len(self.hosts) + 1
        router_ip, host_ip = self._subnet(k)
        outer, inner = f"kv{self.group}r{k}", f"kv{self.group}h{k}"
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", outer, "netns", self.router)
        _ip("addr", "add", f"{router_ip}/30", "dev", outer, netns=self.router)
        _ip("link", "set", outer, "up", netns=self.router)
        netns = None
        if here:
            self._root_links.append(inner)
        else:
            netns = f"{self.router}{name}"
            _ip("netns", "add", netns)
            _ip("link", "set", inner, "netns", netns)
            _ip("link", "set", "lo", "up", netns=netns)
        _ip("addr", "add", f"{host_ip}/30", "dev", inner, netns=netns)
        _ip("link", "set", inner, "up", netns=netns)
        _ip("route", "add", f"198.18.{self.group}.0/24", "via", router_ip, netns=netns)
        host = Host(name, netns, host_ip, inner, outer)
        self.hosts[name] = host
        return host

    def _forward(self, action: str, a: Host, b: Host, *match: str) -> None:
        for src, dst in ((a, b), (b, a)):
            rule = ["FORWARD", "-s", src.address, "-d", dst.address, *match, "-j", "DROP"]
            _in(self.router, "iptables", action, *rule)

    def partition(self, a: Host, b: Host) -> None:
        """Drop every packet between ``a`` and ``b``, silently, until ``heal``."""
        self._forward("-I", a, b)

    def heal(self, a: Host, b: Host) -> None:
        self._forward("-D", a, b)

    def lossy(self, a: Host, b: Host, probability: float) -> None:
        """Drop each packet between ``a`` and ``b`` with ``probability``, until ``clean``."""
        self._forward("-I", a, b, *self._loss(probability))

    def clean(self, a: Host, b: Host, probability: float) -> None:
        self._forward("-D", a, b, *self._loss(probability))

    def slow(self, host: Host, delay_ms: float, jitter_ms: float, loss: float = 0.0) -> None:
        """Every packet to and from ``host`` held ``delay_ms`` +- ``jitter_ms`` (and
        ``loss`` of them dropped) by a relay in the router (tests/support/slow_link.py),
        until ``unslow``: netem's delay, on kernels without netem."""
        tun_in, tun_out = self._tuns(host)
        relay = subprocess.Popen(
            [
                *("ip", "netns", "exec", self.router, sys.executable, "-m"),
                *("tests.support.slow_link", tun_in, tun_out),
                *(str(delay_ms), str(jitter_ms), str(loss)),
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self._relays[host.name] = relay
        assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
        for tun in (tun_in, tun_out):
            _ip("link", "set", tun, "up", netns=self.router)
        # replies come back in on another device than the one their source routes to
        _in(
            self.router,
            "sh",
            "-c",
            "for f in /proc/sys/net/ipv4/conf/*/rp_filter; do echo 0 > $f; done",
        )
        self._steer("add", host)

    def unslow(self, host: Host) -> None:
        """The link of ``host`` as it was before ``slow``."""
        self._steer("del", host)
        relay = self._relays.pop(host.name)
        relay.kill()
        relay.wait()

    def _tuns(self, host: Host) -> tuple[str, str]:
        k = host.link.rsplit("r", 1)[1]
        return f"kv{self.group}t{k}i", f"kv{self.group}t{k}o"

    def _steer(self, action: str, host: Host) -> None:
        """Policy routing through the relay's devices: the host's /32 into the inbound
        one; what comes back out of it, to the host; what the host sends, into the
        outbound one; what comes back out of that, by the main table."""
        tun_in, tun_out = self._tuns(host)
        k = int(host.link.rsplit("r", 1)[1])
        toward, away = str(100 + 2 * k), str(101 + 2 * k)
        _ip("route", action, f"{host.address}/32", "dev", tun_in, netns=self.router)
        _ip("rule", action, "iif", tun_in, "lookup", toward, netns=self.router)
        _ip(
            "route",
            action,
            f"{host.address}/32",
            "dev",
            host.link,
            "table",
            toward,
            netns=self.router,
        )
        _ip("rule", action, "iif", host.link, "lookup", away, netns=self.router)
        _ip("route", action, "default", "dev", tun_out, "table", away, netns=self.router)

    @staticmethod
    def _loss(probability: float) -> tuple[str, ...]:
        return ("-m", "statistic", "--mode", "random", "--probability", f"{probability:.6f}")

    def close(self) -> None:
        """Remove the namespaces (their processes must have stopped) and the links."""
        for relay in self._relays.values():
            relay.kill()
            relay.wait()
        for host in self.hosts.values():
            if host.netns:
                subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=10)
        for link in self._root_links:  # its peer in the router goes with it
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.router], capture_output=True, timeout=10)


@pytest.fixture()
def network():
    """A ``Network`` for one test, removed after it; skips where one cannot be made."""
    why = missing_tools()
    if why:
        pytest.skip(f"no test network: {why}")
    net = Network.make()
    try:
        yield net
    finally:
        net.close()


class NetworkStore:
    """An index (one Valkey) and storage nodes, each on a host of ``network``'s.

    Nodes beat every 0.5 s with a 3 s TTL, so a node cut off from the index stops being
    offered within seconds; they speak UCX over TCP only (no shared memory across
    hosts that share a kernel). Clients use ``client_env`` and ``client_options``."""

    def __init__(self, network: Network, log_dir: str) -> None:
        self.network = network
        self.log_dir = log_dir
        self.client = network.add_host("client", here=True)
        self.index_host = network.add_host("index")
        self.valkey: subprocess.Popen | None = None
        self.nodes: dict[str, tuple[Host, subprocess.Popen]] = {}

    @property
    def redis_url(self) -> str:
        return f"redis://{self.index_host.address}:6379"

    @property
    def client_env(self) -> dict[str, str]:
        return {**os.environ, "UCX_NET_DEVICES": self.client.device, "UCX_TLS": "tcp"}

    # shared memory works across namespaces that share a kernel: these hosts must not
    client_options: ClassVar[dict] = {"same_host": False}

    def start_index(self) -> None:
        from kvstore.tools.procutil import die_with_parent
        from kvstore.tools.valkey import valkey_binary

        argv = self.index_host.argv(
            valkey_binary(),
            *("--bind", self.index_host.address, "--port", "6379", "--save", ""),
            *("--appendonly", "no", "--protected-mode", "no", "--dir", self.log_dir),
        )
        log = open(os.path.join(self.log_dir, "valkey.log"), "ab")
        self.valkey = subprocess.Popen(argv, stdout=log, stderr=log, preexec_fn=die_with_parent)
        log.close()
        _wait(lambda: _answers(self.redis_url), 10, "the index to answer")

    def start_node(self, node_id: str, capacity: str = "128MiB", *extra: str) -> Host:
        """A storage node on a host of its own; returns once it registered."""
        from kvstore.index import PageIndex
        from kvstore.tools.procutil import die_with_parent
        from kvstore.tools.programs import STORAGE_NODE

        host = self.network.hosts.get(node_id) or self.network.add_host(node_id)
        argv = host.argv(
            *STORAGE_NODE.argv(
                *("--redis-url", self.redis_url, "--node-id", node_id),
                *("--capacity", capacity, "--slab-size", "4MiB"),
                *("--host", host.address, "--port", "0"),
                *("--metrics-host", host.address, "--metrics-port", "0"),
                *("--ucx-net-devices", host.device, "--ucx-tls", "tcp"),
                *("--heartbeat-interval", "0.5", "--node-ttl", "3"),
                *extra,
            )
        )
        env = {**os.environ, "KVSTORE_ANONYMOUS": "true", "PYTHONUNBUFFERED": "1"}
        log = open(os.path.join(self.log_dir, f"{node_id}.log"), "ab")
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, preexec_fn=die_with_parent)
        log.close()
        self.nodes[node_id] = (host, proc)
        index = PageIndex(self.redis_url)
        try:
            _wait(
                lambda: proc.poll() is None and node_id in self.live_nodes(index),
                30,
                f"{node_id} to register",
            )
        finally:
            index.close()
        return host

    @staticmethod
    def live_nodes(index) -> set[str]:
        return {n.node_id for n in index.live_nodes()}

    def node_log(self, node_id: str) -> str:
        with open(os.path.join(self.log_dir, f"{node_id}.log"), errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        from kvstore.tools.procutil import stop_process

        for _, proc in self.nodes.values():
            stop_process(proc, 10)
        if self.valkey is not None:
            stop_process(self.valkey, 5)


def _answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _wait(predicate, timeout: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture()
def net_store(network, tmp_path):
    """A ``NetworkStore`` with its index started (nodes: ``start_node``)."""
    store = NetworkStore(network, str(tmp_path))
    try:
        store.start_index()
        yield store
    finally:
        store.stop()
