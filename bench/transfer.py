"""Data-plane throughput and CPU, side by side with memcpy and Valkey, in one run.

    python bench/transfer.py [--total 64MiB] [--sizes 64KiB,2MiB,16MiB] [--repeat 5]
                             [--readers 4] [--plot bench/transfer.png]

Separate processes: one storage node, one writer, ``--readers`` readers (all on
this host), the embedded Valkey. For each page size it moves the same pages with:

- memcpy: a single-thread numpy copy of the same bytes, page by page (the baseline);
- valkey: Valkey as a blob store, pipelined SET (put) and GET (get, copied into the
  destination array as a kvstore get lands in the caller's tensor);
- kvstore shm: ``put_pages``/``get_pages`` through the same-host path (kvstore.wire.shm);
- kvstore ucx: the same calls over UCX (loopback TCP here), ``same_host=False``;
- insert and select (the lookup-buffer API) of the same bytes as key and value
  ``[layers, tokens, heads, head_size]``, on both paths, beside put and get.

Systems are interleaved (memcpy, valkey, shm, ucx, then again) for ``--repeat``
rounds, first with one reader, then with ``--readers`` readers at once (aggregate
GB/s), then with one reader while two CPU-burning processes run. Every put writes
fresh slabs of the node's pool, so each first get maps slabs its reader has never
seen (a cost per slab and process, see client/nodes/connection.py); "get again" reads the
same pages once more, as a long-lived reader of a recycled pool does. Each figure is a
median with min-max, and a ratio to the quiet memcpy of the same size. Gets are
end to end (hash the tokens, one index lookup, transfer, verify) and are checked
bit-exact against the pages put. CPU seconds per GB moved are read from
/proc for the node (or Valkey) and the client process. Last, the idle CPU of the
node, a client that has used both paths, and Valkey, over 5 s.

Then head groups (docs/key-format.md): 2 MiB pages stored by two TP=2 rank clients
(one head group each) and read by a TP=1 client (both groups, merged into its pages)
and by a TP=2 rank (its group), beside a TP=1 client reading pages a TP=1 client
stored (whole pages), on both paths, interleaved, as GB/s of the reader's pages and a
ratio to the same-TP read.

Then the first insert and select in a fresh process against warm ones (``first_calls``).

Last, ``demo_pattern`` (alone: ``--demo-only``): a caller at the demo's geometry (32
layers x 8 heads x 128, fp16, 2,030 tokens, with hidden states) that makes five calls
in a row into fresh prompts, as an application loop does: insert beside put_pages of
the same pages, and select beside get_pages, select both holding the previous result
while it asks for the next (``kv = client.select(...)`` in a loop) and dropping it
first. Ratio: GB/s over the paged call's on the same path."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.transfers.runner import (
    WorkerProcess,
    burners,
    idle_cpu,
    measure,
    plot,
    print_table,
    summarise,
)
from bench.transfers.sections import demo_pattern, first_calls, mla_loads, tp_transfers
from bench.transfers.worker import worker_main
from kvstore.settings.sizes import parse_size

SYSTEMS = ("memcpy", "valkey", "shm", "ucx")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", default="64MiB", help="bytes moved per measurement and reader")
    parser.add_argument("--sizes", default="64KiB,2MiB,16MiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--plot", default=str(Path(__file__).with_name("transfer.png")))
    parser.add_argument(
        "--mla-only", action="store_true", help="only the MLA section (DeepSeek-V3's latent pages)"
    )
    parser.add_argument(
        "--demo-only",
        action="store_true",
        help="only the demo pattern (five inserts/selects in a row at the demo's geometry)",
    )
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker[0], int(args.worker[1]))
        return 0

    from kvstore.tools.launcher import LocalCluster

    if args.mla_only:
        with LocalCluster(servers=1, capacity="4GiB", slab_size="64MiB") as cluster:
            mla_loads(cluster.redis_url, args.repeat)
        return 0
    if args.demo_only:
        demo_pattern(args.repeat)
        return 0
    total, sizes = parse_size(args.total), [parse_size(s) for s in args.sizes.split(",")]
    puts_per_size = (
        2 * 2 * (args.repeat * 2)
    )  # puts and inserts; shm and ucx, quiet and with burners: all kept
    capacity = (
        total * len(sizes) * puts_per_size + 3 * total + 8 * total + (256 << 20)
    )  # + the head-group and first-call sections
    rows: list[tuple[int, str, str, str, dict]] = []  # size, condition, system, op, samples summary
    print(
        f"one node, one writer, {args.readers} readers, all separate processes on this host; "
        f"{args.total} per measurement and reader; median (min-max) of {args.repeat} interleaved rounds",
        flush=True,
    )
    with LocalCluster(servers=1, capacity=str(capacity), slab_size="64MiB") as cluster:
        node_pid, valkey_pid = cluster.nodes[0].process.pid, cluster.valkey.process.pid
        writer = WorkerProcess(cluster.redis_url, total)
        readers = [WorkerProcess(cluster.redis_url, total) for _ in range(args.readers)]
        tag = 0

        def server_of(system: str) -> int:
            return valkey_pid if system == "valkey" else node_pid

        try:
            for size in sizes:
                samples: dict[tuple[str, str, str], list[dict]] = {}
                last_put: dict[str, int] = {}
                for system in SYSTEMS[
                    1:
                ]:  # warm up: connections, mappings, namespaces (not counted)
                    tag += 1
                    measure([writer], "put", system, size, tag, server_of(system))
                    measure(readers, "get", system, size, tag, server_of(system))
                    if system != "valkey":
                        tag += 1
                        measure([writer], "insert", system, size, tag, server_of(system))
                        measure(readers[:1], "select", system, size, tag, server_of(system))
                for condition in ("1 reader", f"{args.readers} readers", "1 reader + 2 burners"):
                    single = condition.startswith("1 ")
                    hogs = burners(2) if "burners" in condition else []
                    try:
                        for _ in range(args.repeat):
                            for system in SYSTEMS:
                                if system == "memcpy":
                                    if single:
                                        samples.setdefault((condition, system, "copy"), []).append(
                                            measure(readers[:1], "copy", system, size, 0, node_pid)
                                        )
                                    continue
                                if (
                                    single
                                ):  # fresh pages (new token ids, same bytes): every put sends
                                    tag += 1
                                    last_put[system] = tag
                                    samples.setdefault((condition, system, "put"), []).append(
                                        measure(
                                            [writer], "put", system, size, tag, server_of(system)
                                        )
                                    )
                                group = (
                                    readers[:1] if single else readers
                                )  # concurrent readers re-read the last pages put
                                samples.setdefault((condition, system, "get"), []).append(
                                    measure(
                                        group,
                                        "get",
                                        system,
                                        size,
                                        last_put[system],
                                        server_of(system),
                                    )
                                )
                                if (
                                    single and system != "valkey"
                                ):  # the same pages again: slabs this reader has mapped
                                    samples.setdefault((condition, system, "get again"), []).append(
                                        measure(
                                            group,
                                            "get",
                                            system,
                                            size,
                                            last_put[system],
                                            server_of(system),
                                        )
                                    )
                                if (
                                    single and system != "valkey"
                                ):  # the same bytes as key/value: insert, then select them back
                                    tag += 1
                                    samples.setdefault((condition, system, "insert"), []).append(
                                        measure(
                                            [writer], "insert", system, size, tag, server_of(system)
                                        )
                                    )
                                    samples.setdefault((condition, system, "select"), []).append(
                                        measure(
                                            readers[:1],
                                            "select",
                                            system,
                                            size,
                                            tag,
                                            server_of(system),
                                        )
                                    )
                    finally:
                        for hog in hogs:
                            hog.kill()
                            hog.wait()
                for (condition, system, op), s in samples.items():
                    rows.append((size, condition, system, op, {k: summarise(s, k) for k in s[0]}))
                print_table([r for r in rows if r[0] == size], size)
            time.sleep(1)
            idle = idle_cpu({"node": node_pid, "client": readers[0].proc.pid, "valkey": valkey_pid})
            print(
                "idle CPU (share of one core, 5 s): "
                + ", ".join(f"{k} {v:.3f}" for k, v in idle.items()),
                flush=True,
            )
            tp_transfers(cluster.redis_url, total, args.repeat)
            mla_loads(cluster.redis_url, args.repeat)
            first_calls(cluster.redis_url, total, max(sizes), args.repeat, tag + 1)
        finally:
            for w in [writer, *readers]:
                w.close()
    demo_pattern(args.repeat)
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    sys.exit(main())
