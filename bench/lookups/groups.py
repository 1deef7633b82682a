"""bench/lookup.py's head and layer groups: lookups of a prompt stored by TP=2 and PP=2
engines, from TP=1, TP=2 and PP=1 engines, against a TP=1 engine's own whole pages."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from bench.lookups.stores import BLOCKS, fmt, publish_units
from kvstore import Namespace, block_hash_bytes, block_hashes
from kvstore.index import PageIndex


def tp_lookups(url: str, iterations: int) -> None:
    """Lookup latency with head groups against whole pages (see the module docstring)."""
    base = dict(model="bench-tp", dtype="float16", num_layers=32, head_size=128, block_size=16)
    same = Namespace(**base, num_kv_heads=8)  # TP=1, one group: whole pages
    tp1 = Namespace(**base, num_kv_heads=8, head_groups=2)  # TP=1 reading what TP=2 stored
    rank = Namespace(**base, num_kv_heads=4, tp_size=2)  # TP=2 rank 0 (two groups by default)
    assert tp1.storage == rank.storage
    pp = Namespace(
        **base, num_kv_heads=8, layer_groups=2
    )  # a PP=1 engine reading what PP=2 stages stored (2 layer groups)
    pp_tp = Namespace(
        **base, num_kv_heads=8, head_groups=2, layer_groups=2
    )  # PP=2 x TP=2 stores: 4 units per block
    index = PageIndex(url)
    stored = list(range(BLOCKS * 16))
    regs = [
        index.register_node(node, f"127.0.0.1:{3 + j}", 1 << 30, 3_600_000)
        for j, node in enumerate(("tp-a", "tp-b"))
    ]
    publish_units(index, regs, same.storage, block_hashes(same.storage, stored), 1)
    publish_units(index, regs, tp1.storage, block_hashes(tp1.storage, stored), 2)
    publish_units(index, regs, pp.storage, block_hashes(pp.storage, stored), 2)
    publish_units(index, regs, pp_tp.storage, block_hashes(pp_tp.storage, stored), 4)
    nodes = index.live_nodes()

    def ask(ns: Namespace, units: tuple[int, int]) -> Callable[[list[int]], int]:
        storage = ns.storage
        return lambda t: (
            index.lookup(storage, block_hash_bytes(storage, t), units=units).resolve(nodes).matched
        )

    systems = [
        ("same TP (TP=1, whole pages)", ask(same, (0, 1))),
        ("TP=2 -> TP=1 (2 groups)", ask(tp1, (0, 2))),
        ("TP=2 -> TP=2 rank (1 group)", ask(rank, (0, 1))),
        ("PP=2 -> PP=1 (2 layer groups)", ask(pp, (0, 2))),
        ("PP=2 x TP=2 -> any (4 units)", ask(pp_tp, (0, 4))),
    ]
    print(
        "\nhead and layer groups: lookup latency, token ids -> locations, ms, median (min-max); ratio to same TP"
    )
    for count in (1024, 8192):
        tokens = stored[: count * 16]
        for name, fn in systems:
            assert fn(tokens) == count, name
        samples: dict[str, list[float]] = {name: [] for name, _ in systems}
        for _ in range(iterations if count < 8192 else max(10, iterations // 3)):
            for name, fn in systems:
                t = time.perf_counter()
                fn(tokens)
                samples[name].append((time.perf_counter() - t) * 1e3)
        base_ms = statistics.median(samples[systems[0][0]])
        print(
            f"{count:>6} blocks | "
            + " | ".join(
                f"{name}: {fmt(samples[name])} ({statistics.median(samples[name]) / base_ms:.2f}x)"
                for name, _ in systems
            ),
            flush=True,
        )
