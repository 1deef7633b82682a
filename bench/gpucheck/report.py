"""The GPU check's report and its tables: the report file, kvstore's warnings kept for it,
and the rows of medians and ratios every section prints. Needs no torch, so bench/gpu_check.py
imports it before the carried wheels are installed."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


class Report:
    """Lines printed at once and appended to ``out``: a run cut short keeps what it had."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        if out:
            out.write_text("")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.out:
            with self.out.open("a") as f:
                f.write(text + "\n")


class Warnings(logging.Handler):
    """kvstore's own warnings (a get that failed on a node says why only there), kept for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if (
            record.name.startswith(("client", "kvstore"))
            and (line := record.getMessage()[:300]) not in self.lines
        ):
            self.lines.append(line)


def rows(
    report: Report,
    times: dict[str, list[float]],
    errors: dict[str, str],
    nbytes: int = 0,
    ratio: bool = True,
) -> None:
    """Median (min-max) of each, and its ratio to the first: of GB/s with ``nbytes``, else of time."""
    first = next(iter(times.values()))
    base = statistics.median(first) if first and ratio else None
    for name, ts in times.items():
        if not ts:
            report(f"  {name:<44} failed: {errors.get(name, 'no rounds')}")
            continue
        med = statistics.median(ts)
        text = f"  {name:<44} {med * 1e3:9.2f} ms ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})"
        text += f" {nbytes / med / 1e9:7.2f} GB/s" if nbytes else ""
        if base:
            text += (
                f"  {base / med:5.2f}x the baseline's GB/s"
                if nbytes
                else f"  {med / base:5.2f}x the baseline's time"
            )
        report(text)
