"""bench/transfer.py's sections after the put/get table: head groups (TP=2 ranks against
TP=1), MLA pages, the first insert and select in a fresh process, and the demo pattern."""

from __future__ import annotations

import statistics
import time

import numpy as np

from bench.transfers.runner import WorkerProcess
from bench.transfers.worker import DEMO_CALLS, DEMO_TOKENS
from kvstore import Namespace


def tp_transfers(redis_url: str, total: int, repeat: int) -> None:
    """Gets across TP sizes against same-TP gets (see bench/transfer.py's docstring)."""
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
    """Five calls in a row at the demo's geometry (see bench/transfer.py's docstring), on a node
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
