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
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore import Namespace
from kvstore.settings.sizes import parse_size

SYSTEMS = ("memcpy", "valkey", "shm", "ucx")


def namespace_for(nbytes: int) -> Namespace:
    """A float16 namespace whose page is exactly ``nbytes`` (2 MiB: one 16-token page of
    a Llama-3-8B-like model, 32 layers x 8 KV heads x 128 dims)."""
    if nbytes % (2 * 32 * 8 * 128 * 2) == 0:
        return Namespace(
            model="bench",
            dtype="float16",
            num_layers=32,
            num_kv_heads=8,
            head_size=128,
            block_size=nbytes // (2 * 32 * 8 * 128 * 2),
            tenant="bench",
        )
    return Namespace(
        model="bench",
        dtype="float16",
        num_layers=1,
        num_kv_heads=1,
        head_size=32,
        block_size=nbytes // 128,
        tenant="bench",
    )


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- worker process: runs one operation per command line on stdin ----------------------


class Worker:
    """Holds clients and pages; each command returns wall time, own CPU and a check."""

    def __init__(self, redis_url: str, total: int) -> None:
        import redis

        self.redis_url = redis_url
        self.total = total
        self.valkey = redis.Redis.from_url(redis_url)
        self.clients: dict[tuple[int, str], object] = {}
        self.pages: dict[int, object] = {}
        self.kv: dict[int, tuple] = {}

    def client(self, size: int, path: str):
        from client import KVCacheClient

        key = (size, path)
        if key not in self.clients:
            self.clients[key] = KVCacheClient(
                self.redis_url,
                namespace_for(size),
                timeout=120,
                lease_ms=0,
                same_host=path == "shm",
            )
        return self.clients[key]

    def data(self, size: int):
        import torch

        if size not in self.pages:
            ns = namespace_for(size)
            gen = torch.Generator().manual_seed(size)
            pages = torch.randint(
                -30000,
                30000,
                (self.total // size, *ns.page_shape),
                dtype=torch.int16,
                generator=gen,
            ).view(torch.float16)
            self.pages[size] = (pages, torch.empty_like(pages))
            # the same bytes as insert/select see them: key and value [layers, tokens, heads, head_size]
            n, _, L, B, H, D = pages.shape
            self.kv[size] = tuple(
                pages[:, i].permute(1, 0, 2, 3, 4).reshape(L, n * B, H, D).contiguous()
                for i in range(2)
            )
        return self.pages[size]

    def run(self, cmd: dict) -> dict:
        import torch

        size, op, system, tag = cmd["size"], cmd["op"], cmd["system"], cmd.get("tag", 0)
        pages, out = self.data(size)
        count = pages.shape[0]
        ns = namespace_for(size)
        tokens = list(range(tag * 10_000_000, tag * 10_000_000 + count * ns.block_size))
        src, dst = (
            pages.view(torch.uint8).reshape(-1).numpy(),
            out.view(torch.uint8).reshape(-1).numpy(),
        )
        # Cleared with numpy, one thread: torch's zero_ runs on its OpenMP pool, whose
        # threads then spin for a while and took the second core from the transfer that
        # followed (measured: same-host get 3.0 GB/s after zero_, 3.8-4.2 after fill or
        # with OMP_WAIT_POLICY=PASSIVE; memcpy unchanged).
        dst.fill(0)
        cpu0, start = time.process_time(), time.time()
        ok = True
        if op == "open":  # client start: UCX, host buffers, namespace, connections (not a transfer)
            self.client(size, system)
        elif system == "memcpy":
            for i in range(count):
                np.copyto(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size])
        elif system == "valkey" and op == "put":
            pipe = self.valkey.pipeline(transaction=False)
            for i in range(count):
                pipe.set(f"bench:{size}:{tag}:{i}", memoryview(src[i * size : (i + 1) * size]))
            pipe.execute()
        elif system == "valkey":
            pipe = self.valkey.pipeline(transaction=False)
            for i in range(count):
                pipe.get(f"bench:{size}:{tag}:{i}")
            for i, blob in enumerate(pipe.execute()):
                dst[i * size : (i + 1) * size] = np.frombuffer(blob, dtype=np.uint8)
        elif op == "put":
            ok = self.client(size, system).put_pages(tokens, pages).stored == count
        elif op == "insert":
            key, value = self.kv[size]
            ok = (
                self.client(size, system)
                .insert(tokens, torch.ones(len(tokens), dtype=torch.bool), key, value)
                .stored
                == count + 1
            )  # and the tail object
        elif op == "select":
            got = self.client(size, system).select(
                tokens, torch.ones(len(tokens), dtype=torch.bool)
            )
        else:
            ok = self.client(size, system).get_pages(tokens, out) == count * ns.block_size
        end, cpu = time.time(), time.process_time() - cpu0
        if op == "get":
            ok = ok and bool(np.array_equal(src, dst))  # bit-exact, outside the timing
        if op == "select":
            # bytes compared (random bits hold NaNs, which torch.equal calls unequal)
            ok = got[2] is not None and all(
                torch.equal(g.view(torch.uint8), k.view(torch.uint8))
                for g, k in zip(got[2:4], self.kv[size])
            )
            del got  # select's tensors go back to the client's pool
        return {"start": start, "end": end, "cpu": cpu, "ok": ok, "bytes": count * size}


DEMO_NS = dict(
    model="bench-demo",
    dtype="float16",
    num_layers=32,
    num_kv_heads=8,
    head_size=128,
    block_size=16,
    hidden_size=4096,
    tenant="bench",
)
DEMO_TOKENS = (
    2030  # kvstore demo's prompt: 126 full blocks, a partial one of 14 tokens, hidden states
)
DEMO_CALLS = 5


class Sequences:
    """The demo pattern's calls (``demo_pattern``), five in a row, in a worker process
    of their own: one client per path, the demo's key/value/hidden, and the same bytes
    as pages for put_pages/get_pages. Each call is checked bit-exact outside its timing."""

    def __init__(self, redis_url: str) -> None:
        import torch

        self.redis_url = redis_url
        self.ns = Namespace(**DEMO_NS)
        self.clients: dict[str, object] = {}
        gen = torch.Generator().manual_seed(41)
        T, ns = DEMO_TOKENS, self.ns

        # random bits (as int16) so no byte pattern is special; compared as bytes
        def bits(*shape: int) -> torch.Tensor:
            return torch.randint(-30000, 30000, shape, dtype=torch.int16, generator=gen).view(
                torch.float16
            )

        self.key, self.value = (
            bits(ns.num_layers, T, ns.num_kv_heads, ns.head_size) for _ in range(2)
        )
        self.hidden = bits(T, ns.hidden_size)
        self.pages = bits(T // ns.block_size, *ns.page_shape)
        self.out = torch.empty_like(self.pages)
        self.roi = torch.ones(T, dtype=torch.bool)

    def client(self, path: str):
        from client import KVCacheClient

        if path not in self.clients:
            self.clients[path] = KVCacheClient(
                self.redis_url, self.ns, timeout=120, lease_ms=0, same_host=path == "shm"
            )
        return self.clients[path]

    def prompts(self, tag: int, tokens: int) -> list[list[int]]:
        firsts = [(tag * DEMO_CALLS + i) * 10_000_000 for i in range(DEMO_CALLS)]
        return [list(range(first, first + tokens)) for first in firsts]

    def run(self, cmd: dict) -> dict:
        """Five calls of ``cmd["call"]`` (insert, put, hold, drop, get; warm: one untimed
        select and get of each prompt) on prompts ``tag``: seconds and bytes per call."""
        import torch

        from client import codec

        client, call, tag = self.client(cmd["system"]), cmd["call"], cmd["tag"]
        blocks = self.pages.shape[0]
        units = blocks + len(
            codec.tail_part_sizes(self.ns, DEMO_TOKENS, True)
        )  # blocks and tail parts
        seq_prompts = self.prompts(2 * tag, DEMO_TOKENS)
        page_prompts = self.prompts(2 * tag + 1, blocks * self.ns.block_size)
        kv_bytes = self.key.nbytes + self.value.nbytes + self.hidden.nbytes
        seconds, cpu, faults, ok, kv = [], [], [], True, None
        for seq, paged in zip(seq_prompts, page_prompts):
            if call == "warm":  # the reader maps the slabs these pages landed in, untimed
                ok &= client.select(seq, self.roi)[2] is not None and client.get_pages(
                    paged, self.out
                ) == len(paged)
                continue
            if call == "drop":
                kv = None  # the previous result goes back to the pool before the next call
            faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start, cpu0 = time.perf_counter(), time.process_time()
            if call == "insert":
                ok &= (
                    client.insert(seq, self.roi, self.key, self.value, self.hidden).stored == units
                )
            elif call == "put":
                ok &= client.put_pages(paged, self.pages).stored == self.pages.shape[0]
            elif call == "get":
                ok &= client.get_pages(paged, self.out) == len(paged)
            else:  # hold, drop
                kv = client.select(seq, self.roi)
            seconds.append(time.perf_counter() - start)
            cpu.append(
                time.process_time() - cpu0
            )  # every thread of the client: the copy, its helper, UCX's
            faults.append(
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted
            )  # fresh memory shows here
            if call == "get":
                ok &= torch.equal(self.out.view(torch.int16), self.pages.view(torch.int16))
            elif call in ("hold", "drop"):
                wanted = (self.key, self.value, self.hidden)
                ok &= kv[2] is not None and all(
                    torch.equal(g.view(torch.int16), w.view(torch.int16))
                    for g, w in zip(kv[2:], wanted)
                )
        moved = self.pages.nbytes if call in ("put", "get") else kv_bytes
        return {"seconds": seconds, "cpu": cpu, "faults": faults, "bytes": moved, "ok": bool(ok)}


def worker_main(redis_url: str, total: int) -> None:
    worker, sequences = Worker(redis_url, total), None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        if cmd.get("op") == "sequence":
            sequences = sequences or Sequences(redis_url)
            print(json.dumps(sequences.run(cmd)), flush=True)
            continue
        print(json.dumps(worker.run(cmd)), flush=True)
    for c in [*worker.clients.values(), *(sequences.clients.values() if sequences else ())]:
        c.close()


class WorkerProcess:
    def __init__(self, redis_url: str, total: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", redis_url, str(total)],
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


# ---- the run -------------------------------------------------------------------------


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


def tp_transfers(redis_url: str, total: int, repeat: int) -> None:
    """Gets across TP sizes against same-TP gets (see the module docstring)."""
    import torch

    from client import KVCacheClient

    base = dict(
        model="bench-tp",
        dtype="float16",
        num_layers=32,
        head_size=128,
        block_size=16,
        tenant="bench",
    )
    same = Namespace(**base, num_kv_heads=8)
    ranks = [Namespace(**base, num_kv_heads=4, tp_rank=r, tp_size=2) for r in range(2)]
    tp1 = Namespace(**base, num_kv_heads=8, head_groups=2)
    blocks = total // same.page_nbytes
    tokens = list(range(blocks * 16))
    full = torch.from_numpy(
        np.random.default_rng(7).integers(
            0, 1 << 15, size=(blocks, *same.page_shape), dtype=np.int16
        )
    ).view(torch.float16)

    def rank_pages(
        ns: Namespace, _tokens: list[int]
    ) -> torch.Tensor:  # the model's pages, this rank's heads
        lo, hi = ns.head_range
        return full.narrow(1 + ns.head_dim, lo, hi - lo).contiguous()

    print(
        f"\nhead groups: {blocks} pages of 2 MiB (TP=1) read end to end, GB/s of the reader's pages, median (min-max) of {repeat} interleaved rounds; ratio to same TP"
    )
    for path in ("shm", "ucx"):
        opts = {"same_host": path == "shm"}
        writers = [KVCacheClient(redis_url, ns, **opts) for ns in (same, *ranks)]
        for client in writers:
            assert client.put_pages(tokens, rank_pages(client.namespace, tokens)).stored == blocks
        readers = {
            "same TP (TP=1 -> TP=1)": KVCacheClient(redis_url, same, **opts),
            "TP=2 -> TP=1 (2 groups)": KVCacheClient(redis_url, tp1, **opts),
            "TP=2 -> TP=2 rank (1 group)": KVCacheClient(redis_url, ranks[0], **opts),
        }
        outs = {
            name: torch.empty(blocks, *c.namespace.page_shape, dtype=torch.float16)
            for name, c in readers.items()
        }
        rates: dict[str, list[float]] = {name: [] for name in readers}
        for _ in range(repeat + 1):  # the first round warms connections and mappings
            for name, client in readers.items():
                t = time.perf_counter()
                assert client.get_pages(tokens, outs[name]) == len(tokens)
                rates[name].append(outs[name].numel() * 2 / (time.perf_counter() - t) / 1e9)
        for name, client in readers.items():
            assert torch.equal(
                outs[name].view(torch.uint8), rank_pages(client.namespace, tokens).view(torch.uint8)
            ), name
        base_rate = statistics.median(rates["same TP (TP=1 -> TP=1)"][1:])
        print(
            f"  {path}: "
            + " | ".join(
                f"{name}: {statistics.median(r[1:]):.2f} ({min(r[1:]):.2f}-{max(r[1:]):.2f}) {statistics.median(r[1:]) / base_rate:.2f}x"
                for name, r in rates.items()
            ),
            flush=True,
        )
        for client in [*writers, *readers.values()]:
            client.close()


def mla_loads(redis_url: str, repeat: int) -> None:
    """Loads of a 4,096-token prompt at DeepSeek-V3's geometry: 61 layers of one 576-wide
    bf16 latent row per token (layout ``vllm_mla``), in blocks of 16 (vLLM's CPU MLA
    backend) and 64 (FlashMLA's), against the same bytes in 17 MiB pages (the per-page
    costs left out) and a memcpy of them, interleaved."""
    import torch

    from client import KVCacheClient

    cases = {
        f"MLA block {bs}": Namespace(
            model="bench-deepseek-v3",
            dtype="bfloat16",
            num_layers=61,
            num_kv_heads=1,
            head_size=576,
            block_size=bs,
            layout="vllm_mla",
            tenant="bench",
        )
        for bs in (16, 64)
    }
    nbytes, ntokens = 4096 * 61 * 576 * 2, 4096
    # the same bytes per token (2 x 61 x 288 x 2 = 70,272) in blocks of 256 tokens: 16 pages of 17 MiB
    cases["same bytes, 17 MiB pages"] = Namespace(
        model="bench-mla-big",
        dtype="bfloat16",
        num_layers=61,
        num_kv_heads=1,
        head_size=288,
        block_size=256,
        tenant="bench",
    )
    rng = np.random.default_rng(9)
    print(
        f"\nMLA (DeepSeek-V3: 61 layers x 576 bf16 per token): a 4,096-token prompt ({nbytes / 2**20:.0f} MiB) loaded end to end, "
        f"ms and GB/s, median (min-max) of {repeat} interleaved rounds; ratio to a memcpy of the same bytes",
        flush=True,
    )
    for n, path in enumerate(("shm", "ucx")):
        tokens = list(
            range(n * 4096, (n + 1) * 4096)
        )  # other pages per path: a put of stored pages sends nothing
        clients, pages, outs = {}, {}, {}
        for name, ns in cases.items():
            blocks = len(tokens) // ns.block_size
            clients[name] = KVCacheClient(redis_url, ns, same_host=path == "shm")
            raw = rng.integers(0, 1 << 15, size=(blocks, *ns.page_shape), dtype=np.int16)
            pages[name] = torch.from_numpy(raw).view(torch.bfloat16)
            assert clients[name].put_pages(tokens, pages[name]).stored == blocks
            outs[name] = torch.empty_like(pages[name])
        src, dst = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        src.fill(1)
        dst.fill(0)
        times: dict[str, list[float]] = {name: [] for name in [*cases, "memcpy"]}
        for _ in range(repeat + 1):  # the first round warms connections and mappings
            for name, client in clients.items():
                t = time.perf_counter()
                assert client.get_pages(tokens, outs[name]) == len(tokens)
                times[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            np.copyto(dst, src)
            times["memcpy"].append(time.perf_counter() - t)
        for name in cases:
            assert torch.equal(outs[name].view(torch.int16), pages[name].view(torch.int16)), name
        base = statistics.median(times["memcpy"][1:])
        for name, t in times.items():
            ms = [x * 1e3 for x in t[1:]]
            pages_n = ntokens // cases[name].block_size if name in cases else 0
            per_page = (
                f", {pages_n} pages of {cases[name].page_nbytes / 2**20:.2f} MiB" if pages_n else ""
            )
            print(
                f"  {path:3} {name:26} {statistics.median(ms):7.1f} ms ({min(ms):.1f}-{max(ms):.1f}) "
                f"{nbytes / statistics.median(t[1:]) / 1e9:5.2f} GB/s  {statistics.median(t[1:]) / base:.2f}x memcpy{per_page}",
                flush=True,
            )
        for client in clients.values():
            client.close()


def first_calls(redis_url: str, total: int, size: int, repeat: int, tag: int) -> None:
    """The first insert and select in a fresh process against warm ones: a new process
    per round and path starts its client (timed apart: UCX, host buffers, namespace,
    connections), then inserts and selects fresh tokens once, then three more times.
    Ratio: first call's time over the median warm call's, per round; median (min-max)."""
    print(
        f"\nfirst call in a fresh process, {total >> 20} MiB of {size >> 10} KiB pages as key/value, {repeat} rounds; "
        "ratio of the first call's time to the median of 3 warm calls in the same process",
        flush=True,
    )
    ratios: dict[tuple[str, str], list[float]] = {}
    starts: dict[str, list[float]] = {}
    for _ in range(repeat):
        for path in ("shm", "ucx"):
            proc = WorkerProcess(redis_url, total)
            try:
                proc.send(op="open", system=path, size=size)
                opened = proc.result()
                starts.setdefault(path, []).append(opened["end"] - opened["start"])
                times: dict[str, list[float]] = {"insert": [], "select": []}
                for _call in range(4):
                    tag += 1
                    for op in ("insert", "select"):
                        proc.send(op=op, system=path, size=size, tag=tag)
                        r = proc.result()
                        if not r["ok"]:
                            raise SystemExit(f"{path} {op} was not complete and bit-exact")
                        times[op].append(r["end"] - r["start"])
                for op, t in times.items():
                    ratios.setdefault((path, op), []).append(t[0] / statistics.median(t[1:]))
            finally:
                proc.close()
    for (path, op), r in ratios.items():
        print(
            f"  {path} {op}: first/warm {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})",
            flush=True,
        )
    for path, s in starts.items():
        print(
            f"  {path} client start: {statistics.median(s) * 1000:.0f} ms ({min(s) * 1000:.0f}-{max(s) * 1000:.0f})",
            flush=True,
        )


def demo_pattern(repeat: int) -> None:
    """Five calls in a row at the demo's geometry (see the module docstring), on a node
    of its own whose pool recycles slabs (3 GiB: a round's ten prompts are 2.7 GB), so
    the reader has mapped every slab after the first rounds, as a long-lived one has.
    Per path and round: five inserts and five put_pages of fresh prompts, one untimed
    read of each (slabs mapped), then five selects holding, five dropping and five
    get_pages, their order rotated each round; the first round warms up. Figures: GB/s
    per call, median (min-max) over every call of the counted rounds; ratio: median
    over the median of the paged call on the same path (put_pages for insert,
    get_pages for select), with the range of the same ratio round by round; and the
    client's CPU time and page faults per call (fresh memory costs a fault per 4 KiB
    touched), which other processes on the host disturb less than the wall time.
    Bytes: key, value and hidden for insert/select (2,030 tokens), the 126 pages for
    put/get."""
    from kvstore.tools.launcher import LocalCluster

    print(
        f"\ndemo pattern: {DEMO_TOKENS} tokens at 32 layers x 8 heads x 128, fp16, with hidden states, "
        f"{DEMO_CALLS} calls in a row into fresh prompts, {repeat} rounds; GB/s per call, median (min-max); "
        "ratio to put_pages (insert) or get_pages (select)",
        flush=True,
    )
    with LocalCluster(servers=1, capacity="3GiB", slab_size="64MiB") as cluster:
        proc = WorkerProcess(cluster.redis_url, 1 << 20)
        rates: dict[tuple[str, str], list[float]] = {}  # every call's GB/s
        rounds: dict[tuple[str, str], list[float]] = {}  # each round's median GB/s
        faults: dict[tuple[str, str], list[int]] = {}  # the client's page faults per call
        cpu: dict[tuple[str, str], list[float]] = {}  # the client's CPU seconds per call
        try:
            tag = 0
            for r in range(repeat + 1):
                for path in ("shm", "ucx"):
                    tag += 1
                    reads = ["hold", "drop", "get"]
                    reads = reads[r % 3 :] + reads[: r % 3]
                    writes = ["insert", "put"] if r % 2 else ["put", "insert"]
                    for call in [*writes, "warm", *reads]:
                        proc.send(op="sequence", system=path, call=call, tag=tag)
                        got = proc.result()
                        if not got["ok"]:
                            raise SystemExit(
                                f"demo pattern: {path} {call} was not complete and bit-exact"
                            )
                        if r and call != "warm":
                            calls = [got["bytes"] / t / 1e9 for t in got["seconds"]]
                            rates.setdefault((path, call), []).extend(calls)
                            rounds.setdefault((path, call), []).append(statistics.median(calls))
                            faults.setdefault((path, call), []).extend(got["faults"])
                            cpu.setdefault((path, call), []).extend(got["cpu"])
        finally:
            proc.close()
    names = {
        "insert": "insert",
        "put": "put_pages",
        "hold": "select, holding the last",
        "drop": "select, dropping it first",
        "get": "get_pages",
    }
    for path in ("shm", "ucx"):
        for call, base in (
            ("put", None),
            ("insert", "put"),
            ("get", None),
            ("hold", "get"),
            ("drop", "get"),
        ):
            r = rates[(path, call)]
            ratio = ""
            if base:  # and the ratio of the same round's medians, the round-to-round swing
                paired = [a / b for a, b in zip(rounds[(path, call)], rounds[(path, base)])]
                ratio = (
                    f"  {statistics.median(r) / statistics.median(rates[(path, base)]):.2f}x {names[base]} "
                    f"(rounds {min(paired):.2f}-{max(paired):.2f})"
                )
            f, c = faults[(path, call)], cpu[(path, call)]
            print(
                f"  {path:3} {names[call]:26} {statistics.median(r):5.2f} GB/s ({min(r):.2f}-{max(r):.2f}){ratio}; "
                f"client CPU {statistics.median(c) * 1e3:.0f} ms, "
                f"page faults {statistics.median(f):.0f} ({min(f)}-{max(f)}) per call",
                flush=True,
            )


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


if __name__ == "__main__":
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    sys.exit(main())
