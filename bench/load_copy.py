"""Does hashing while copying keep verification off a load's critical path?

    python bench/load_copy.py [--rounds 10] [--blocks 96]

The same-host load copies each page from the node's mapped slot into the engine's
cache blocks (a page is one block of every layer: ten scattered pieces) and verifies
its xxh3 checksum before the engine may read the block. Interleaved round by round
(A B C D E A B C D E), in one process, on the TTFT bench's shape (10 layers, 8 KV
heads x 64 x 32 tokens, float32: 1.25 MiB pages):

- copy only:          numpy copies piece by piece on both threads, no verification
                      (baseline);
- Python loop:        copy and hash 1 MiB chunks in Python, each hashed while in cache,
                      both threads (what ``copy_checksummed`` did before its C loop);
- C loop:             ``copy_checksummed`` as a load runs it: one C call per thread
                      without the GIL, 64 KiB at a time, non-temporal stores (a copy of
                      at least ``STREAM_MIN``);
- C loop, cached stores: the same with plain ``memcpy`` stores;
- hash after:         copy everything (both threads), then hash each slot (both threads).

The source is a memfd mapping faulted in beforehand (as a node's slab is), the cache
tensors too. Prints medians with min-max in ms and GB/s, and each as a ratio to the
copy-only time."""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.pages import checksum
from kvstore.pages.checksum import _copy_one, _pieces_chunks, copy_checksummed

LAYERS, HEADS, BLOCK, HEAD_SIZE = 10, 8, 32, 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=96)
    args = ap.parse_args()
    n = args.blocks
    layers = [
        torch.zeros((n * 2, HEADS, BLOCK, 2 * HEAD_SIZE), dtype=torch.float32)
        for _ in range(LAYERS)
    ]
    byte_layers = [kv.view(torch.uint8).numpy() for kv in layers]
    blocks = list(range(1, 2 * n, 2))  # every other block: runs of one, as a fragmented cache gives
    page_nbytes = LAYERS * byte_layers[0][0].nbytes
    fd = os.memfd_create("kvstore-bench-slab")
    os.ftruncate(fd, n * page_nbytes)
    slab = np.frombuffer(mmap.mmap(fd, n * page_nbytes), dtype=np.uint8)
    slab[:] = np.random.default_rng(0).integers(0, 255, slab.nbytes, dtype=np.uint8)
    slots = [slab[i * page_nbytes : (i + 1) * page_nbytes] for i in range(n)]
    pieces = [tuple(layer[b] for layer in byte_layers) for b in blocks]
    expected = [xxhash.xxh3_64_intdigest(s) for s in slots]
    pool = ThreadPoolExecutor(2)

    def plain_copy(i: int) -> None:
        pos = 0
        for chunk in _pieces_chunks(pieces[i]):
            chunk[...] = slots[i][pos : pos + chunk.nbytes].reshape(chunk.shape)
            pos += chunk.nbytes

    def halves(fn) -> list:
        return [
            x
            for part in pool.map(lambda r: [fn(i) for i in r], (range(0, n // 2), range(n // 2, n)))
            for x in part
        ]

    def copy_only() -> None:
        halves(plain_copy)

    pairs = list(zip(pieces, slots))

    def python_loop() -> None:
        assert halves(lambda i: _copy_one(pieces[i], slots[i], False)) == expected

    def c_loop() -> None:
        assert copy_checksummed(pairs) == expected

    def c_loop_cached() -> None:
        assert (
            halves(lambda i: checksum._copy_loop.copy_hash([pairs[i]], False, False)[0]) == expected
        )

    def after() -> None:
        halves(plain_copy)
        assert halves(lambda i: xxhash.xxh3_64_intdigest(slots[i])) == expected

    if checksum._copy_loop is None:
        sys.exit("the C loop is not bound (see the warning above)")
    ways = {
        "copy only (baseline)": copy_only,
        "Python loop (before)": python_loop,
        "C loop (the load)": c_loop,
        "C loop, cached stores": c_loop_cached,
        "hash after copying": after,
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for fn in ways.values():
        fn()  # warm: threads started, code paths taken once
    for _ in range(args.rounds):
        for name, fn in ways.items():
            began = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - began)
    base = statistics.median(times["copy only (baseline)"])
    total = n * page_nbytes
    print(
        f"# {n} pages of {page_nbytes / 2**20:.2f} MiB ({total / 2**20:.0f} MiB) from a memfd mapping into "
        f"{LAYERS} layer tensors, {args.rounds} rounds interleaved, {os.cpu_count()} cores"
    )
    print("| way | median ms | min–max ms | GB/s | ratio to copy only |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"| {name} | {med * 1000:.1f} | {min(ts) * 1000:.1f}–{max(ts) * 1000:.1f} | {total / med / 1e9:.2f} | {med / base:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
