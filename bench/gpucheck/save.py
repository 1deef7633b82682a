"""Sections 4 and 5 of the GPU check (bench/gpu_check.py): the save path against decode
steps, and the device tests run where a GPU is."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

import torch

from bench.gpucheck.device import Dev, same
from bench.gpucheck.layerwise import llama
from bench.gpucheck.prepare import missing
from bench.gpucheck.report import ROOT, MiB, Report, rows


def section_save(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    if why := missing(("client.paging.paged_cache",)):
        report(f"  skipped: {why}")
        return
    from client.memory.buffers import block_runs
    from client.paging.paged_cache import PagedCache
    from client.paging.staging_pool import StagingPool

    d, layer = llama(dev)
    n = d["tokens"] // d["block"]  # a 4,096-token prompt's blocks, saved as its prefill ends
    shape = (
        4 * n,
        d["block"],
        d["heads"],
        2 * d["head"],
    )  # FlashAttention's LBNHC, seen as vLLM 0.32's view
    cache = PagedCache(
        [
            torch.randn(shape, dtype=d["dtype"], device=dev.device).permute(0, 2, 1, 3)
            for _ in range(d["layers"])
        ]
    )
    ids = [b for run in range(0, 4 * n, 32) for b in range(run, run + 16)][:n]  # runs of 16 blocks
    pool, x0 = (
        StagingPool(cache, 1, n),
        torch.randn((d["batch"], d["hidden"]), dtype=d["dtype"], device=dev.device),
    )

    def before(
        host: Any,
    ) -> Any:  # the save as it was: strided copies per run and layer, D2H on the compute stream
        scratch = torch.empty((n, *cache.page_shape), dtype=cache.dtype, device=dev.device)
        for li, kv in enumerate(cache.layers):
            for page, block, length in block_runs(ids):
                scratch[page : page + length, li].copy_(kv[block : block + length])
        host.copy_(scratch, non_blocking=True)
        return dev.event()

    saves = {
        "no save (baseline)": lambda h: None,
        "before: gather, D2H on the compute stream": before,
        "PagedCache.gather (one copy kernel, D2H on its own stream)": lambda h: (
            cache.gather(ids, h).ready
        ),
    }
    first, later, call = ({k: [] for k in saves} for _ in range(3))
    exact = True
    for r in range(args.rounds + 1):
        for name, save in saves.items():
            host = pool.take_pages(n)
            dev.sync()
            start = time.perf_counter()
            ready = save(host)
            call[name].append(time.perf_counter() - start)
            for k in range(4):
                t = time.perf_counter()
                x = x0
                for _ in range(d["layers"]):
                    x = layer(x)
                dev.sync(compute_only=True)
                if r:
                    (first if k == 0 else later)[name].append(
                        time.perf_counter() - (start if k == 0 else t)
                    )
            if ready is not None:
                ready.synchronize()
            if r == 1 and name != "no save (baseline)":
                exact = exact and all(
                    same(host[:, li], kv[ids]) for li, kv in enumerate(cache.layers)
                )
            pool.give_pages(host)
    save_mib = n * cache.page_nbytes / MiB
    report(
        f"  decode steps of {d['batch']} tokens x {d['layers']} layers; a save of {n} blocks ({save_mib:.1f} MiB) "
        f"from an LBNHC cache issued before the first; bit-exact {exact}"
    )
    report("  first step after the save is issued (from the save call on):")
    rows(report, first, {})
    report("  each of the three steps after it:")
    rows(report, later, {})
    report("  the save call itself (engine thread):")
    rows(report, {k: v[1:] for k, v in call.items() if k != "no save (baseline)"}, {}, ratio=False)


def section_tests(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    why = missing(("pytest", "client.paging.paged_cache"))
    if why or not (dev.cuda or args.tests):
        report(
            f"  skipped: {why or 'no GPU here (its CUDA cases need one; --tests runs it anyway)'}"
        )
        return
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--maxfail=10",
        "tests/client/test_paged_cache.py",
        "tests/kvstore/pages/test_device_checksum.py",
        "tests/client/test_device_loads.py",
        "tests/client/test_device_pacing.py",
        "tests/client/test_device_layerwise.py",
        "tests/client/test_device_get_parts.py",
        "tests/client/test_device_slot_reads.py",
        # makes credentials with the kvstore command, which the carried wheels' site
        # does not reach there; a protocol test, run on the CPU
        "--deselect",
        "tests/client/test_device_slot_reads.py::test_a_notice_is_never_answered_and_one_refused_changes_nothing",
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    report(f"  {' '.join(cmd[1:])}: exit {res.returncode}")
    out = [x for x in res.stdout.splitlines() if x.strip()]
    failed = [x for x in out if x.startswith(("FAILED", "ERROR"))]
    for line in (
        out[-8:] + [x for x in failed if x not in out[-8:]] + res.stderr.strip().splitlines()[-3:]
    ):
        report(f"    {line}")
