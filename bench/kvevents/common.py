"""What bench/events.py's sections (bench/kvevents/) share: the repository root, a page's
token count, a figure as median (min-max), and a process's CPU time per thread from /proc."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


BLOCK_TOKENS = 16  # a node's page of an 8B model: 2 MiB, 16 tokens (64 bytes of token ids)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"


def cpu_ns(pid: int, tids: list[int] | None = None) -> dict[int, int]:
    """Nanoseconds on a CPU per thread of ``pid`` (``/proc/<pid>/task/<tid>/schedstat``:
    exact, where ``cpu_seconds`` counts clock ticks of 10 ms)."""
    out = {}
    for tid in tids if tids is not None else [int(t) for t in os.listdir(f"/proc/{pid}/task")]:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except OSError:
            pass  # the thread ended
    return out
