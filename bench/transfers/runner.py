"""bench/transfer.py's side of its workers and its tables: a worker process started and
driven (``WorkerProcess``, ``measure``), CPU-burning processes, idle CPU, the markdown
table and the plot. Used by bench/transfer.py and bench/transfers/sections.py."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.benchcommon.proc import cpu_seconds

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "transfer.py"  # a worker is the bench itself, with --worker


class WorkerProcess:
    def __init__(self, redis_url: str, total: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--worker", redis_url, str(total)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("a benchmark worker died")
            if line.startswith("{"):
                return json.loads(line)
            # UCXX writes its warnings to stdout ("[time] [host] ... UCXX WARN ...")
            sys.stderr.write(line)

    def close(self) -> None:
        try:
            self.send(op="quit")
            self.proc.wait(60)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.proc.kill()


def burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(
    readers: list[WorkerProcess], op: str, system: str, size: int, tag: int, server_pid: int
) -> dict:
    """One operation on every given worker at once: aggregate GB/s and CPU per GB."""
    server0 = cpu_seconds(server_pid)
    for w in readers:
        w.send(op=op, system=system, size=size, tag=tag)
    results = [w.result() for w in readers]
    server = cpu_seconds(server_pid) - server0
    moved = sum(r["bytes"] for r in results)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    if not all(r["ok"] for r in results):
        raise SystemExit(f"{system} {op} of {size}-byte pages was not complete and bit-exact")
    return {
        "gbps": moved / wall / 1e9,
        "client_cpu_per_gb": sum(r["cpu"] for r in results) / (moved / 1e9),
        "server_cpu_per_gb": server / (moved / 1e9),
    }


def summarise(samples: list[dict], key: str) -> tuple[float, float, float]:
    values = [s[key] for s in samples]
    return statistics.median(values), min(values), max(values)


def idle_cpu(pids: dict[str, int], seconds: float = 5.0) -> dict[str, float]:
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    time.sleep(seconds)
    return {k: (cpu_seconds(p) - before[k]) / seconds for k, p in pids.items()}


def print_table(rows: list, size: int) -> None:
    base = next(r[4]["gbps"][0] for r in rows if r[2] == "memcpy" and r[1] == "1 reader")
    print(
        f"\n| {size >> 10} KiB pages | system | op | GB/s | min-max | x memcpy | client CPU s/GB | server CPU s/GB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for _, condition, system, op, fig in rows:
        med, lo, hi = fig["gbps"]
        server = "" if system == "memcpy" else f"{fig['server_cpu_per_gb'][0]:.2f}"
        print(
            f"| {condition} | {system} | {op} | {med:.2f} | {lo:.2f}-{hi:.2f} | {med / base:.2f} | {fig['client_cpu_per_gb'][0]:.2f} | {server} |"
        )
    print(flush=True)


def plot(rows: list, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return
    sizes = sorted({r[0] for r in rows})
    conditions = list(dict.fromkeys(r[1] for r in rows))
    series = list(dict.fromkeys((r[2], r[3]) for r in rows))
    fig, axes = plt.subplots(
        1, len(sizes), figsize=(6 * len(sizes), 4.5), sharey=True, squeeze=False
    )
    width = 0.8 / len(series)
    for ax, size in zip(axes[0], sizes):
        for k, (system, op) in enumerate(series):
            figs = {
                r[1]: r[4]["gbps"] for r in rows if r[0] == size and (r[2], r[3]) == (system, op)
            }
            xs = [c + k * width for c, cond in enumerate(conditions) if cond in figs]
            med = [figs[cond][0] for cond in conditions if cond in figs]
            err = [
                [m - figs[cond][1] for m, cond in zip(med, [c for c in conditions if c in figs])],
                [figs[cond][2] - m for m, cond in zip(med, [c for c in conditions if c in figs])],
            ]
            ax.bar(xs, med, width, yerr=err, label=f"{system} {op}", capsize=2)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(conditions))], conditions, fontsize=8)
        ax.set_title(f"{size >> 10} KiB pages")
        ax.set_ylabel("GB/s (median, min-max)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
