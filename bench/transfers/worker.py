"""bench/transfer.py's worker processes (``transfer.py --worker``): ``Worker`` runs one
operation per command line on stdin (put, get, insert, select, copy) and answers with its
wall time, its own CPU and a bit-exact check; ``Sequences`` runs the demo pattern's calls.
``namespace_for`` (the geometry of a page size) is bench/tier.py's too."""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np

from kvstore import Namespace


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
