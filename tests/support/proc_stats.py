"""A process's CPU time and its threads' wake-ups so far, from /proc: what an idle node
or client must not spend (tests/server/test_server_process.py and its child processes)."""

from __future__ import annotations

import os


def thread_wakeups(pid: int | str) -> int:
    """Voluntary context switches of every thread of a process so far: one per time a
    thread slept and woke."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                total += next(
                    int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches")
                )
        except (OSError, StopIteration):
            pass  # a thread that ended meanwhile
    return total


def cpu_seconds(pid: int | str) -> float:
    """User and system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
