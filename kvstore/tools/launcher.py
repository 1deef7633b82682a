"""A local store on loopback: embedded Valkey plus N storage-node processes.

Used by ``kvstore up``, ``kvstore demo`` and the test fixtures. Node processes are
started as ``python -m server`` with PDEATHSIG, so they stop if this process dies;
``stop`` sends SIGTERM and waits, then SIGKILLs stragglers. Unless ``quiet=False``
(output inherited), each node's output goes to ``<log_dir>/<node_id>.log``."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import KVStoreError
from kvstore.index import PageIndex
from kvstore.index.urls import split_password
from kvstore.tools.procutil import die_with_parent
from kvstore.tools.programs import STORAGE_NODE, Program
from kvstore.tools.valkey import EmbeddedValkey, EmbeddedValkeyCluster


@dataclass
class NodeProcess:
    """One started storage node: its process, and where its output goes (what the
    cluster reports when it exits)."""

    node_id: str
    process: subprocess.Popen
    log_path: Path | None = None

    def log(self) -> str:
        """What the node printed so far ('' when its output is inherited)."""
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def exit_reason(self) -> str:
        """The last line the node wrote (its error, once it stopped), for the user."""
        return _last_line(self.log()) or "no output (see its log)"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)


class LocalCluster:
    """``servers`` storage nodes and, unless ``redis_url`` names one or ``index`` hands
    over one started already, an embedded index: one Valkey, or a Valkey cluster of
    ``index_shards`` primaries when that is above 1.

    The index password (``redis_password``, or one inside ``redis_url``) reaches the
    nodes as ``KVSTORE_REDIS_PASSWORD`` in their environment, as the Helm chart hands
    it over, never on their command lines (which ``/proc/<pid>/cmdline`` shows to
    every user of the host)."""

    def __init__(
        self,
        servers: int = 1,
        capacity: str = "256MiB",
        *,
        redis_url: str | None = None,
        redis_password: str | None = None,
        index_shards: int = 1,
        slab_size: str = "16MiB",
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        quiet: bool = True,
        log_dir: str | None = None,
        disk_path: str | None = None,
        disk_capacity: str | None = None,
        progress: Callable[[str], None] | None = None,
        node_program: Program = STORAGE_NODE,
        index_port: int | None = None,
        index: EmbeddedValkey | EmbeddedValkeyCluster | None = None,
    ) -> None:
        self.num_servers = servers
        # `kvstore up` prints each step of a start
        self._progress = progress or (lambda _line: None)
        self.node_program = node_program  # what each node runs (kvstore.tools.programs)
        self.disk_path = disk_path  # each node's disk tier is <disk_path>/<node id>
        self.disk_capacity = disk_capacity
        self.index_shards = index_shards
        self.index_port = index_port  # the embedded one-shard index's, when given
        self.capacity = capacity
        self.slab_size = slab_size
        self.extra_args = extra_args or []
        self.env = {**os.environ, "UCX_NET_DEVICES": "lo", **(env or {})}
        if not _has_credential(self.env, self.extra_args):
            # a loopback store for tests and the demo; `kvstore up` passes a token
            self.env["KVSTORE_ANONYMOUS"] = "true"
        self.quiet = quiet
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.log_dir: Path | None = None
        if quiet and log_dir:
            self.log_dir = Path(log_dir)
        elif quiet:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-nodes-")
            self.log_dir = Path(self._tmp.name)
        # ``index``: an embedded index started already (a test's spare, which saves a
        # Valkey cluster's 2 s wait for its slots to be served), owned and stopped here
        self.valkey: EmbeddedValkey | EmbeddedValkeyCluster | None = index
        self.redis_url, in_url = split_password(index.url if index else redis_url or "")
        self.redis_password = redis_password or in_url
        if self.redis_password:
            self.env["KVSTORE_REDIS_PASSWORD"] = self.redis_password
            self.env.pop("KVSTORE_REDIS_PASSWORD_FILE", None)  # the same password, already read
        self.nodes: list[NodeProcess] = []

    def start(self, timeout: float = 30.0) -> LocalCluster:
        if not self.redis_url:
            self._progress("starting the index (embedded Valkey)")
            self.valkey = (
                EmbeddedValkeyCluster(self.index_shards)
                if self.index_shards > 1
                else EmbeddedValkey(self.index_port)
            ).start()
            self.redis_url = self.valkey.url
        for i in range(self.num_servers):
            self.add_node(f"node-{i}")
        if self.num_servers:
            self._progress(
                f"starting {self.num_servers} storage node(s): "
                f"each faults in {self.capacity} of page memory before it registers"
            )
            self.wait_registered(timeout)
        return self

    def add_node(self, node_id: str, extra_args: list[str] | None = None) -> NodeProcess:
        """Start one more storage node (it registers itself; see ``wait_registered``)."""
        args = self.node_program.argv(
            "--redis-url",
            self.redis_url,
            "--capacity",
            self.capacity,
            "--slab-size",
            self.slab_size,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--node-id",
            node_id,
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
            *self.disk_args(node_id),
            *self.extra_args,
            *(extra_args or []),
        )
        log_path = None
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{node_id}.log"
            out = open(log_path, "ab")  # noqa: SIM115 - the child keeps the descriptor
        try:
            proc = subprocess.Popen(
                args,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                preexec_fn=die_with_parent,
            )
        finally:
            if out:
                out.close()
        node = NodeProcess(node_id, proc, log_path)
        self.nodes.append(node)
        return node

    def restart_node(self, node_id: str) -> NodeProcess:
        """Start ``node_id`` again in place of its exited process (``kvstore up``'s
        supervisor): the same id, options and disk directory, so it warm-restarts with
        the pages its disk tier kept; its log file is appended to. Returns the new
        process without waiting for it to register."""
        at = next(i for i, n in enumerate(self.nodes) if n.node_id == node_id)
        if self.nodes[at].process.poll() is None:
            raise KVStoreError(f"{node_id} still runs: it is not restarted over itself")
        new = self.add_node(node_id)
        self.nodes.pop()  # add_node appended it: it takes the old one's place instead
        self.nodes[at] = new
        return new

    def disk_args(self, node_id: str) -> list[str]:
        """A node's disk tier options: a subdirectory of ``disk_path`` of its own, so a
        node restarted under the same id finds its pages again."""
        if not self.disk_path:
            return []
        return [
            "--disk-path",
            os.path.join(self.disk_path, node_id),
            *(["--disk-capacity", self.disk_capacity] if self.disk_capacity else []),
        ]

    def wait_registered(self, timeout: float = 30.0) -> None:
        index = PageIndex(self.redis_url, password=self.redis_password)
        started = time.monotonic()
        deadline = started + timeout
        seen: set[str] = set()
        try:
            while True:
                live = {n.node_id for n in index.live_nodes()}
                for node_id in sorted(live - seen):
                    if any(n.node_id == node_id for n in self.nodes):
                        self._progress(
                            f"{node_id} registered after {time.monotonic() - started:.1f} s"
                        )
                seen |= live
                running = [n for n in self.nodes if n.process.poll() is None]
                if all(n.node_id in live for n in running) and running:
                    return
                dead = [
                    n.node_id
                    for n in self.nodes
                    if n.process.poll() is not None and n.node_id not in live
                ]
                if dead and len(dead) == len(self.nodes):
                    reasons = "; ".join(
                        f"{n.node_id}: {n.exit_reason()}" for n in self.nodes if n.node_id in dead
                    )
                    raise KVStoreError(f"storage nodes exited during start ({reasons})")
                if time.monotonic() > deadline:
                    raise KVStoreError(
                        f"storage nodes did not register within {timeout:.0f} s: "
                        + self._late_reasons(live)
                    )
                time.sleep(0.05)
        finally:
            index.close()

    def _late_reasons(self, live: set[str]) -> str:
        """Why nodes are late, slow told from dead: each unregistered node's state (exited
        and how, or still running) and last log line, and the host's load, since a node
        that is still starting on a saturated host is slow, not broken."""
        parts = []
        for node in self.nodes:
            if node.node_id in live:
                continue
            code = node.process.poll()
            state = "still starting" if code is None else f"exited ({code})"
            parts.append(f"{node.node_id} {state}, its last log line: {node.exit_reason()}")
        load = os.getloadavg()[0]
        cores = os.cpu_count() or 1
        busy = "; the host is saturated" if load > cores else ""
        return "; ".join(parts) + f" (load average {load:.1f} on {cores} cores{busy})"

    def restart_nodes(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> float:
        """Kill every node (kill -9 by default) and start each again under its id (and its
        disk directory); returns the seconds until all are ready again (registered, and
        the pages their disk tiers kept re-published: /readyz)."""
        ids = [n.node_id for n in self.nodes if n.process.poll() is None]
        for node in self.nodes:
            node.kill(sig)
            node.process.wait()
        self.nodes.clear()
        started = time.monotonic()
        for node_id in ids:
            self.add_node(node_id)
        self.wait_registered(timeout)
        self.wait_ready(timeout)
        return time.monotonic() - started

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every registered node's /readyz answers 200."""
        import urllib.request

        index = PageIndex(self.redis_url, password=self.redis_password)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                pending = 0
                for node in index.live_nodes():
                    try:
                        pending += (
                            urllib.request.urlopen(
                                f"http://{node.extra['metrics']}/readyz", timeout=2
                            ).status
                            != 200
                        )
                    except (OSError, KeyError):
                        pending += 1
                if not pending:
                    return
                time.sleep(0.05)
        finally:
            index.close()
        raise KVStoreError(f"storage nodes were not ready within {timeout:.0f} s")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill(signal.SIGTERM)
        for node in self.nodes:
            try:
                node.process.wait(15)
            except subprocess.TimeoutExpired:
                node.kill()
                node.process.wait()
        self.nodes.clear()
        if self.valkey:
            self.valkey.stop()
            self.valkey = None
        if self._tmp:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _has_credential(env: dict[str, str], args: list[str]) -> bool:
    """True when the nodes get a data-plane credential from ``env`` or ``args``."""
    names = ("AUTH_TOKEN", "AUTH_TOKEN_FILE", "CREDENTIALS_FILE")
    return any(env.get(f"KVSTORE_{n}") for n in names) or any(
        a.split("=")[0] in ("--auth-token", "--auth-token-file", "--credentials-file") for a in args
    )


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
