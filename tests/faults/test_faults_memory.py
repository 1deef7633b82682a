"""Memory pressure as a pod has it: a storage node and an engine's scratch process share
one memory limit (a cgroup), and the scratch process grows until the kernel's OOM
killer must pick one of them.

A node's page memory is reserved up front, so it is the largest process there and the
kernel's first pick: every engine then loses its cached prefixes at once. With
``--oom-score-adj`` (server/oom.py) the kernel kills the scratch process instead and the
node goes on serving what it held."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from client import KVCacheClient
from kvstore.tools.launcher import LocalCluster
from kvstore.tools.programs import STORAGE_NODE, Program
from tests.support.helpers import namespace_for_page_size, pages_for
from tests.support.worker import same_bytes

pytestmark = [pytest.mark.faults, pytest.mark.process]

LIMIT = 900 << 20  # the "pod's" memory limit
CAPACITY = "512MiB"  # the node's page memory, faulted in at start


def memory_cgroup_root() -> Path | None:
    """This process's memory cgroup (v1) where a child can be made, or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            root = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if os.access(root, os.W_OK):
                return root
    return None


@pytest.fixture()
def pod():
    """A memory cgroup (v1) limited to ``LIMIT``; its ``procs`` file takes a pid."""
    root = memory_cgroup_root()
    if root is None or os.geteuid() != 0:
        pytest.skip("no writable cgroup v1 memory controller (needs root) to make a pod's limit")
    group = root / f"kvstore-pod-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(LIMIT))
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        group.rmdir()


class InGroup(Program):
    """A program that joins the cgroup ``procs`` before it starts (LocalCluster's
    node_program seam)."""

    def __init__(self, program: Program, procs: Path) -> None:
        super().__init__(program.module, program.description)
        object.__setattr__(self, "procs", procs)

    def argv(self, *args: str) -> list[str]:
        join = f'echo $$ > {self.procs} && exec "$@"'  # type: ignore[attr-defined]
        return ["sh", "-c", join, "sh", *super().argv(*args)]


def grow_until_killed(procs: Path) -> subprocess.Popen:
    """An engine's scratch process: takes 16 MiB more every 20 ms, touched, in the pod."""
    code = "import time\nheld = []\nwhile True:\n    held.append(bytearray(b'x') * (16 << 20))\n    time.sleep(0.02)\n"
    join = f'echo $$ > {procs} && exec "$@"'
    return subprocess.Popen(["sh", "-c", join, "sh", sys.executable, "-c", code])


def may_lower_oom_scores() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE, which lowering an OOM score needs."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


@pytest.mark.parametrize("protected", [False, True], ids=["inherited-score", "oom-score-adj"])
def test_the_oom_killer_picks_the_scratch_process_over_a_protected_node(pod, protected):
    """Unprotected, the node is the kernel's pick (what a saturated host showed as
    every get a miss); with --oom-score-adj -900 the scratch process is, and the node
    serves all it held."""
    if protected and not may_lower_oom_scores():
        pytest.skip("lowering an OOM score needs CAP_SYS_RESOURCE, which this container lacks")
    extra = ["--oom-score-adj", "-900"] if protected else []
    program = InGroup(STORAGE_NODE, pod / "cgroup.procs")
    with LocalCluster(
        1, CAPACITY, slab_size="16MiB", extra_args=extra, node_program=program
    ) as cluster:
        node = cluster.nodes[0].process
        ns = namespace_for_page_size(1 << 20, tenant=f"oom-{protected}")
        tokens = list(range(64 * ns.block_size))
        pages = pages_for(ns, tokens)
        with KVCacheClient(cluster.redis_url, ns, timeout=10) as client:
            assert client.put_pages(tokens, pages).stored == 64
            scratch = grow_until_killed(pod / "cgroup.procs")
            try:
                scratch.wait(60)  # the limit is reached within seconds
            finally:
                if scratch.poll() is None:
                    scratch.kill()
            time.sleep(0.5)
            if not protected:
                # the node was the larger of the two: the kernel took it first (then the
                # scratch process, alone, grew to the limit again)
                assert node.poll() == -9
                return
            assert scratch.returncode == -9  # SIGKILL from the kernel
            assert node.poll() is None, cluster.nodes[0].log()[-2000:]
            out = pages.new_empty(pages.shape)
            assert client.get_pages(tokens, out) == len(tokens)
            assert same_bytes(out, pages)
        assert "oom_score_adj set to -900" in cluster.nodes[0].log()


def test_the_node_takes_the_score_it_is_given(clusters):
    """The option reaches the kernel (a raise, which needs no privilege, so it runs in
    any container), and a refused one is a warning, not a failed start."""
    cluster = clusters(extra=["--oom-score-adj", "10"])
    pid = cluster.nodes[0].process.pid
    assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "10"
    assert "oom_score_adj set to 10" in cluster.nodes[0].log()
    if not may_lower_oom_scores():
        refused = clusters(extra=["--oom-score-adj", "-500"])
        assert refused.nodes[0].process.poll() is None
        assert "could not set oom_score_adj to -500" in refused.nodes[0].log()
