"""``kvstore up`` supervises the nodes it started (kvstore.tools.supervise): a node that
dies (kill -9 here, as the kernel's OOM killer does) is reported at once with its
signal and last log line, restarted under its id and disk directory (its pages found
again), given up on after ``--max-restarts``; ``kvstore stats`` and ``kvstore down``
say so. And a ``--capacity`` that cannot fit in MemAvailable is refused at once."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore.errors import InvalidInputError
from kvstore.index import PageIndex
from kvstore.tools.procutil import pid_alive
from kvstore.tools.supervise import check_memory, death_cause, memory_available
from tests.support.helpers import (
    KVSTORE_CLI,
    as_bytes,
    cli_env,
    namespace_for_page_size,
    pages_for,
    wait_for,
)

pytestmark = [pytest.mark.faults, pytest.mark.process]


class Up:
    """A ``kvstore up`` process whose output lines are read by a thread, so every wait
    for one is bounded."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.state = tmp_path / "state"
        self.logs = tmp_path / "logs"
        self.proc = subprocess.Popen(
            [
                *KVSTORE_CLI,
                "up",
                "--capacity",
                "64MiB",
                "--slab-size",
                "16MiB",
                "--state-dir",
                str(self.state),
                "--log-dir",
                str(self.logs),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env(),
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self.wait_line("export KVSTORE_REDIS_URL=", 60).strip().split("=", 1)[1]
        self.token_file = self.wait_line("export KVSTORE_AUTH_TOKEN_FILE=", 5).strip()
        self.token_file = self.token_file.split("=", 1)[1]
        self.wait_line("press Ctrl-C", 10)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)

    def wait_line(self, needle: str, timeout: float) -> str:
        """The next line of up's output holding ``needle`` (read within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            self.lines.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no line with {needle!r} within {timeout} s: {self.lines}")

    def node_pid(self, node_id: str) -> int:
        """The node's pid as up keeps it in its state directory."""
        doc = json.loads((self.state / "supervision.json").read_text())
        return int(doc["nodes"][node_id]["pid"])

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*KVSTORE_CLI, *args, "--state-dir", str(self.state)],
            capture_output=True,
            text=True,
            timeout=60,
            env=cli_env(),
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def node_figure(url: str, node_id: str, name: str) -> int | None:
    """A figure of the node's registry entry (its pid, its heartbeat's counters)."""
    index = PageIndex(url)
    try:
        entry = next((n for n in index.live_nodes() if n.node_id == node_id), None)
    finally:
        index.close()
    value = entry.extra.get(name, "") if entry else ""
    return int(value) if value.isdigit() else None


def registered_pid(url: str, node_id: str) -> int | None:
    return node_figure(url, node_id, "pid")


def test_a_killed_node_is_reported_and_restarted_with_its_disk_pages(tmp_path):
    from client import KVCacheClient

    up = Up(
        tmp_path,
        "--disk-path",
        str(tmp_path / "disk"),
        "--disk-capacity",
        "64MiB",
        "--disk-policy",
        "write-through",  # every page on disk when its put returns
    )
    try:
        ns = namespace_for_page_size(64 << 10, tenant="supervised")
        tokens = list(range(8 * ns.block_size))
        with KVCacheClient(up.url, ns, auth_token_file=up.token_file) as client:
            assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 8
        # written through in the background: the heartbeat tells when all 8 are on disk
        wait_for(lambda: node_figure(up.url, "node-0", "disk_pages") == 8, 20, "8 pages on disk")
        victim = up.node_pid("node-0")
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        line = up.wait_line("node-0 (pid", 5)
        assert time.monotonic() - killed < 5
        assert f"node-0 (pid {victim}) died: killed by SIGKILL" in line, line
        assert "its last log line: " in line and "restarting it in 1 s" in line, line
        assert "kvstore up: node-0" in (up.logs / "node-0.log").read_text()  # and in its log
        back = up.wait_line("node-0 is back", 20)
        new_pid = up.node_pid("node-0")
        assert new_pid != victim and f"pid {new_pid}" in back
        assert registered_pid(up.url, "node-0") == new_pid
        # the same disk directory: the restarted node re-publishes what it stored
        with KVCacheClient(up.url, ns, auth_token_file=up.token_file) as client:
            wait_for(lambda: client.lookup(tokens) == len(tokens), 20, "the pages after restart")
            out = torch.empty(8, *ns.page_shape, dtype=torch.float16)
            assert client.get_pages(tokens, out) == len(tokens)
            assert torch.equal(as_bytes(out), as_bytes(pages_for(ns, tokens)))  # bit for bit
        assert "recovered" in (up.logs / "node-0.log").read_text()  # from its disk tier

        stats = up.cli("stats", "--redis-url", up.url)
        assert stats.returncode == 0, stats.stderr
        assert re.search(
            r"node-0 died 1 time\(s\), restarted 1 time\(s\), running as pid \d+; "
            r"last death at [\d:]+: killed by SIGKILL",
            stats.stdout,
        ), stats.stdout
        doc = json.loads(up.cli("stats", "--json", "--redis-url", up.url).stdout)
        assert doc["up"]["nodes"]["node-0"]["deaths"] == 1
        down = up.cli("down")
        assert down.returncode == 0, down.stderr
        assert "while it ran, node-0 died 1 time(s), restarted 1 time(s)" in down.stdout
        assert up.proc.wait(30) == 0
    finally:
        up.stop()


def test_a_node_that_keeps_dying_is_given_up_on(tmp_path):
    up = Up(tmp_path, "--servers", "2", "--max-restarts", "1")
    try:
        bystander = up.node_pid("node-1")
        os.kill(up.node_pid("node-0"), signal.SIGKILL)
        assert "restart 1 of at most 1" in up.wait_line("node-0 (pid", 5)
        up.wait_line("node-0 is back", 20)
        os.kill(up.node_pid("node-0"), signal.SIGKILL)
        line = up.wait_line("node-0 (pid", 5)
        assert "given up on: it died 2 times within 10 min" in line, line
        assert up.proc.poll() is None  # node-1 still serves, untouched
        assert pid_alive(bystander) and registered_pid(up.url, "node-1") == bystander
        stats = up.cli("stats", "--redis-url", up.url)
        assert "node-0 died 2 time(s), restarted 1 time(s), given up on" in stats.stdout
        down = up.cli("down")
        assert "node-0 died 2 time(s), restarted 1 time(s), given up on" in down.stdout
    finally:
        up.stop()


def test_a_capacity_beyond_available_memory_is_refused_in_one_line(tmp_path):
    available = memory_available()
    assert available is not None
    capacity = f"{available // (1 << 20) // 2 + 1024}MiB"  # two of them: 2 GiB too many
    started = time.monotonic()
    out = subprocess.run(
        [*KVSTORE_CLI, "up", "--servers", "2", "--capacity", capacity]
        + ["--state-dir", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "MemAvailable" in out.stderr, out.stderr
    assert f"2 node(s) of --capacity {capacity} need about" in out.stderr
    assert time.monotonic() - started < 20 and "starting" not in out.stdout  # nothing started


def test_memory_check_warns_near_the_limit_and_names_causes():
    gib = 1 << 30
    assert check_memory(2, "1GiB", 20 * gib) is None
    warning = check_memory(2, "7GiB", 16 * gib)
    assert warning and "little is left" in warning
    with pytest.raises(InvalidInputError, match="lower --capacity or --servers"):
        check_memory(3, "7GiB", 16 * gib)
    assert check_memory(1, "lots", 16 * gib) is None  # the node says why
    assert death_cause(3, None) == "exit code 3"
    assert death_cause(-signal.SIGSEGV, 0) == "killed by SIGSEGV"
    assert "likely the kernel's OOM killer" in death_cause(-signal.SIGKILL, None)
    assert "the kernel's OOM killer (memory.events's oom_kill went up by 1)" in death_cause(
        -signal.SIGKILL, 1, Path("/sys/fs/cgroup/x/memory.events")
    )
