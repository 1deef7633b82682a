"""Mooncake Store's side of bench/vs_mooncake.py, run by the Python of a virtualenv that has
``mooncake-transfer-engine`` (bench/vs_mooncake.py says how to make one). It only needs
numpy and mooncake.

    python vs_mooncake_worker.py storage HOST:PORT METADATA_URL MASTER SEGMENT_BYTES
    python vs_mooncake_worker.py client  HOST:PORT METADATA_URL MASTER PAGES PAGE_BYTES

``storage`` mounts a segment of the given size and serves it until stdin closes (the
role a storage node plays). ``client`` mounts none, registers two buffers of
``PAGES * PAGE_BYTES`` (source and destination: the zero-copy batch API, Mooncake's
fastest) and answers one line per command on stdin: ``put ROUND`` stores the source
under fresh keys of that round (``batch_put_from``), ``get ROUND`` reads them back
(``batch_get_into``); each answer is ``seconds ok`` (ok: every page stored, or read
back byte-identical)."""

from __future__ import annotations

import sys
import time

import numpy as np
from mooncake.store import MooncakeDistributedStore


def main() -> int:
    role, local, metadata, master = sys.argv[1:5]
    store = MooncakeDistributedStore()
    segment = int(sys.argv[5]) if role == "storage" else 0
    if store.setup(local, metadata, segment, 256 << 20, "tcp", "", master) != 0:
        print("setup failed", flush=True)
        return 1
    print("ready", flush=True)
    if role == "storage":
        sys.stdin.read()
        return 0
    pages, size = int(sys.argv[5]), int(sys.argv[6])
    source = np.random.default_rng(0).integers(0, 255, pages * size, dtype=np.uint8)
    dest = np.zeros_like(source)
    for buf in (source, dest):
        if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
            print("register failed", flush=True)
            return 1
    src_ptrs = [source.ctypes.data + i * size for i in range(pages)]
    dst_ptrs = [dest.ctypes.data + i * size for i in range(pages)]
    for line in sys.stdin:
        op, round_ = line.split()
        keys = [f"bench-{round_}-{i}" for i in range(pages)]
        began = time.perf_counter()
        if op == "put":
            results = store.batch_put_from(keys, src_ptrs, [size] * pages)
            seconds = time.perf_counter() - began
            ok = all(r == 0 for r in results)
        else:
            dest[:] = 0
            began = time.perf_counter()
            results = store.batch_get_into(keys, dst_ptrs, [size] * pages)
            seconds = time.perf_counter() - began
            ok = all(r == size for r in results) and np.array_equal(dest, source)
        print(f"{seconds} {int(ok)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
