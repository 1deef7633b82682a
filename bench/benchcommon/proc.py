"""A process's CPU time from /proc: bench/transfer.py (and its bench/transfers/ modules),
bench/events.py and bench/tier.py read a node's, Valkey's and their clients' with it."""

from __future__ import annotations

import os


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
