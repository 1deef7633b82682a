"""What ``kvstore up`` does about its storage nodes once they run: a node that dies is
reported at once (one line on ``up``'s output and in the node's log: its exit code or
signal, the likely cause, the last line it wrote) and started again under the same
node id, so the same disk directory (``LocalCluster.restart_node``), within a bounded
``RestartPolicy``. What happened is kept in the state directory
(``UpState.write_supervision``) for ``kvstore stats`` and ``kvstore down``.

Also the start's memory check (``check_memory``): a node faults in its whole
``--capacity`` of page memory before it registers, so a store that does not fit beside
the machine's free memory is refused before anything starts.

Called from ``kvstore.tools.cli_up`` only, on ``up``'s main thread (no locking)."""

from __future__ import annotations

import collections
import contextlib
import re
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.errors import InvalidInputError, KVStoreError
from kvstore.settings.sizes import format_size, parse_size

if TYPE_CHECKING:
    from kvstore.index import PageIndex
    from kvstore.tools.launcher import LocalCluster, NodeProcess

# A node's resident memory besides its page memory (docs/operations.md, "Memory to budget").
NODE_OVERHEAD = 80 << 20


@dataclass(frozen=True)
class RestartPolicy:
    """At most ``max_restarts`` restarts of one node within ``window_s`` seconds; the
    n-th death in the window waits ``first_delay_s * 2**(n-1)`` seconds (at most
    ``max_delay_s``) before the restart. A node that dies once more is given up on.

    The defaults: 5 restarts in 10 minutes, after 1, 2, 4, 8, 16 s. An OOM kill or a
    stray kill -9 comes back at once, and a node that cannot stay up (its memory does
    not fit, its disk fails) is given up on within about half a minute of trying
    instead of looping, and fighting the OOM killer, until someone looks."""

    max_restarts: int = 5
    window_s: float = 600.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0

    def delay(self, recent_deaths: int) -> float:
        """Seconds to wait before restarting a node that died ``recent_deaths`` times
        within the window (this death included)."""
        return min(self.first_delay_s * 2 ** max(recent_deaths - 1, 0), self.max_delay_s)


@dataclass
class NodeRecord:
    """What ``up`` tells of one node (persisted as JSON for ``stats`` and ``down``)."""

    pid: int = 0
    deaths: int = 0
    restarts: int = 0
    last_cause: str = ""
    last_death: float = 0.0  # wall-clock time (time.time())
    given_up: bool = False


class OomCounter:
    """The kernel's count of OOM kills in this process's memory cgroup (the nodes are
    started in it): ``memory.events`` under cgroup v2, ``memory.oom_control`` under v1,
    both lines ``oom_kill N`` counting kills by the global and the cgroup's OOM killer.
    ``read`` is None when neither can be read (then a SIGKILL's cause is a guess)."""

    def __init__(self, proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"):
        self.path: Path | None = None
        with contextlib.suppress(OSError):
            for line in Path(proc_cgroup).read_text().splitlines():
                _, controllers, rel = line.split(":", 2)
                if controllers == "":  # v2: one unified hierarchy
                    candidate = Path(root) / rel.lstrip("/") / "memory.events"
                elif "memory" in controllers.split(","):
                    candidate = Path(root) / "memory" / rel.lstrip("/") / "memory.oom_control"
                else:
                    continue
                if self._parse(candidate) is not None:
                    self.path = candidate
                    break

    def read(self) -> int | None:
        return self._parse(self.path) if self.path else None

    @staticmethod
    def _parse(path: Path) -> int | None:
        try:
            found = re.search(r"^oom_kill (\d+)$", path.read_text(), re.MULTILINE)
        except OSError:
            return None
        return int(found.group(1)) if found else None


def death_cause(returncode: int, oom_kills: int | None, oom_file: Path | None = None) -> str:
    """Why a node's process ended, in words: its exit code or signal. A SIGKILL that
    ``up`` did not send (it never does while serving) is the kernel's OOM killer when
    the cgroup's ``oom_kill`` counter went up since the last look (``oom_kills``: by how
    much, None when unreadable); unreadable, it is named the likely cause."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if -returncode != signal.SIGKILL:
        return f"killed by {name}"
    if oom_kills is None:
        return "killed by SIGKILL, not sent by kvstore up: likely the kernel's OOM killer"
    # the counter is the whole cgroup's: another process's OOM kill counts too
    counter = f"{oom_file.name if oom_file else 'its cgroup'}'s oom_kill"
    if oom_kills > 0:
        return f"killed by SIGKILL: the kernel's OOM killer ({counter} went up by {oom_kills})"
    return (
        f"killed by SIGKILL, not sent by kvstore up and not by the OOM killer "
        f"({counter} unchanged): a kill -9 from outside"
    )


@dataclass
class _Watch:
    """Supervision of one node id, not persisted."""

    deaths: collections.deque[float] = field(default_factory=collections.deque)
    restart_at: float | None = None  # monotonic time a restart is due
    started_at: float | None = None  # monotonic start of a restart awaiting registration


class Supervisor:
    """Watches ``cluster``'s nodes for ``kvstore up``: ``poll`` (every half second from
    ``up``'s serve loop) reports each death in one line through ``report``, restarts
    the node when ``policy`` allows and says when it registered again; ``persist`` is
    handed the JSON-ready document after every change. ``stopping`` is checked before a
    death is reported: nodes exiting because ``up`` is being stopped (Ctrl-C reaches
    the whole process group) are not deaths."""

    def __init__(
        self,
        cluster: LocalCluster,
        *,
        policy: RestartPolicy,
        report: Callable[[str], None],
        persist: Callable[[dict[str, Any]], None],
        stopping: Callable[[], bool] = lambda: False,
        index_url: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self._report = report
        self._persist = persist
        self._stopping = stopping
        self._clock = clock
        self._index_url = index_url
        self._oom = OomCounter()
        self._oom_seen = self._oom.read()
        self._index: PageIndex | None = None
        self.records = {n.node_id: NodeRecord(pid=n.process.pid) for n in cluster.nodes}
        self._watch = {n.node_id: _Watch() for n in cluster.nodes}
        self.save()

    def document(self) -> dict[str, Any]:
        """What ``stats`` and ``down`` read (``UpState.read_supervision``)."""
        return {
            "index_url": self._index_url,
            "policy": asdict(self.policy),
            "nodes": {node_id: asdict(rec) for node_id, rec in self.records.items()},
        }

    def save(self) -> None:
        self._persist(self.document())

    def poll(self) -> bool:
        """One look at every node: report deaths, start due restarts, announce the
        restarted nodes that registered. False once no node runs or will run again
        (all given up), True otherwise."""
        now = self._clock()
        for node in list(self.cluster.nodes):
            watch = self._watch[node.node_id]
            record = self.records[node.node_id]
            if node.process.poll() is None or record.given_up:
                continue
            if watch.restart_at is None:
                if self._stopping():
                    return True
                self._died(node, watch, record, now)
            elif now >= watch.restart_at:
                new = self.cluster.restart_node(node.node_id)
                record.pid, record.restarts = new.process.pid, record.restarts + 1
                watch.restart_at, watch.started_at = None, now
                self.save()
        self._announce_registered()
        return any(
            n.process.poll() is None or self._watch[n.node_id].restart_at is not None
            for n in self.cluster.nodes
        )

    def _died(self, node: NodeProcess, watch: _Watch, record: NodeRecord, now: float) -> None:
        oom = self._oom.read()
        oom_delta = None if oom is None or self._oom_seen is None else oom - self._oom_seen
        self._oom_seen = oom
        cause = death_cause(node.process.returncode, oom_delta, self._oom.path)
        last = node.exit_reason()
        watch.started_at = None
        watch.deaths.append(now)
        while watch.deaths and watch.deaths[0] < now - self.policy.window_s:
            watch.deaths.popleft()
        record.deaths += 1
        record.last_cause, record.last_death = cause, time.time()
        recent = len(watch.deaths)
        window = f"{self.policy.window_s / 60:g} min"
        if recent > self.policy.max_restarts:
            record.given_up = True
            then = f"given up on: it died {recent} times within {window}"
        else:
            delay = self.policy.delay(recent)
            watch.restart_at = now + delay
            then = (
                f"restarting it in {delay:g} s (restart {recent} of at most "
                f"{self.policy.max_restarts} within {window})"
            )
        line = (
            f"{node.node_id} (pid {node.process.pid}) died: {cause}; its last log line: "
            f"{last}; {then}"
        )
        if node.log_path is not None:  # beside what the node wrote, for whoever reads it later
            with contextlib.suppress(OSError), open(node.log_path, "a") as log:
                log.write(f"kvstore up: {line}\n")
        self.save()
        self._report(line)  # last: whoever reads it finds the log and the state already saying so

    def _announce_registered(self) -> None:
        awaiting = {
            n.node_id: n
            for n in self.cluster.nodes
            if self._watch[n.node_id].started_at is not None and n.process.poll() is None
        }
        if not awaiting:
            return
        from kvstore.index import PageIndex

        try:
            if self._index is None:
                self._index = PageIndex(
                    self.cluster.redis_url, password=self.cluster.redis_password
                )
            # the dead process's entry stays until it expires: the new one is the new pid's
            live = {(n.node_id, n.extra.get("pid")) for n in self._index.live_nodes()}
        except KVStoreError:
            return  # the index is unreachable for now: the next poll looks again
        for node_id, node in awaiting.items():
            watch = self._watch[node_id]
            if (node_id, str(node.process.pid)) in live and watch.started_at is not None:
                took = self._clock() - watch.started_at
                watch.started_at = None
                self._report(
                    f"{node_id} is back (pid {node.process.pid}, restart "
                    f"{self.records[node_id].restarts}): registered {took:.1f} s after its restart"
                )

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """One line per node that died under ``up`` (none when none did), for ``up``'s
    last words, ``kvstore stats`` and ``kvstore down``; ``doc`` is
    ``Supervisor.document()``."""
    lines = []
    for node_id, rec in sorted(doc.get("nodes", {}).items()):
        if not rec.get("deaths"):
            continue
        when = time.strftime("%H:%M:%S", time.localtime(rec.get("last_death", 0)))
        state = "given up on" if rec.get("given_up") else f"running as pid {rec.get('pid')}"
        lines.append(
            f"{node_id} died {rec['deaths']} time(s), restarted {rec.get('restarts', 0)} "
            f"time(s), {state}; last death at {when}: {rec.get('last_cause', '?')}"
        )
    return lines


def memory_available(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes (the kernel's estimate of what can be taken without
    swapping), None when it cannot be read."""
    with contextlib.suppress(OSError):
        found = re.search(r"^MemAvailable:\s+(\d+) kB$", Path(meminfo).read_text(), re.MULTILINE)
        if found:
            return int(found.group(1)) * 1024
    return None


def check_memory(servers: int, capacity: str, available: int | None) -> str | None:
    """``kvstore up``'s start check. Raises ``InvalidInputError`` (one line) when the
    nodes' page memory plus their overhead exceeds ``available`` (MemAvailable): every
    node faults its capacity in before it registers, so such a store fails its start
    or, worse, has the OOM killer kill a node or another user's process. Returns a
    warning when it fits but leaves less than a fifth of ``available`` to the rest of
    the machine; None when it fits, when ``available`` is unknown, or when ``capacity``
    cannot be read (the node says why)."""
    if available is None:
        return None
    try:
        each = parse_size(capacity)
    except InvalidInputError:
        return None
    need = servers * (each + NODE_OVERHEAD)
    what = (
        f"{servers} node(s) of --capacity {capacity} need about {format_size(need)} "
        f"(page memory, faulted in at start, + {format_size(NODE_OVERHEAD)} each)"
    )
    if need > available:
        raise InvalidInputError(
            f"{what}, more than the {format_size(available)} this machine has available "
            "(MemAvailable in /proc/meminfo): lower --capacity or --servers"
        )
    if need > 0.8 * available:
        return (
            f"warning: {what}, {need / available:.0%} of the {format_size(available)} "
            "available: little is left for engines and other processes"
        )
    return None
