"""Sections 1 and 2 of the GPU check (bench/gpu_check.py): same-host loads into device
memory, and gets into device memory over UCX on loopback."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpucheck.device import SIZES, Dev, caches, interleave, same, stored_pages, whole
from bench.gpucheck.report import MiB, Report, rows


def section_h2d(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    from client.paging.loader import PageLoader
    from client.paging.staging_pool import StagingPool
    from client.vllm.metadata import LoadSpec
    from kvstore.pages import device_checksum

    for label, shape in SIZES.items():
        client, src, tokens, ns = stored_pages(cluster, dev, shape, args.total)
        staged, *_ = stored_pages(
            cluster, dev, shape, 0, transfer_mode="staged"
        )  # the path before: CPU copy + hash, then one H2D
        n, nbytes = src.shape[0], src.numel() * src.element_size()
        ref = src.to(dev.device)
        dst, out, out_staged = torch.empty_like(ref), torch.empty_like(ref), torch.empty_like(ref)
        ids = list(range(3, 3 + 2 * n, 2))  # scattered blocks, as a running engine's
        # blocks in one run (a fresh engine's): a block-major cache lands them in place
        # in copies that merge (client.paging.loader.copies_pay)
        blocks_of = {"BLHNC, one run": list(range(3, 3 + n))}
        paged = caches(ns, 2 * n + 4, dev)
        stream = dev.stream()
        loaders = {
            name: PageLoader(
                client,
                cache,
                StagingPool(cache, 1, n),
                block_size=ns.block_size,
                layer_groups=[],
                load_stream=stream,
                credential_refused=lambda exc: None,
            )
            for name, cache in paged.items()
        }
        found: list[Any] = [None]
        if label == "64 KiB":
            report(
                f"  device copier: {type(client._async.device).__name__ if client._async.device else None}; "
                f"lands on {dev.device}: {client.lands_on_device(dev.device)}; "
                f"why not: {getattr(client._async.device, 'unusable', None)}"
            )

        def load(name: str) -> Callable[[], None]:
            def run() -> None:
                spec = LoadSpec("r", found[0], blocks_of.get(name, ids), 0)
                outcome = loaders[name].load(spec, None)
                if outcome.failed:
                    raise RuntimeError(f"{len(outcome.failed)} blocks failed")

            return run

        errors: dict[str, str] = {}
        times = interleave(
            {
                "torch pinned H2D copy (baseline)": lambda: dst.copy_(src, non_blocking=True),
                "get_pages -> device (registered shm, device check)": lambda: whole(
                    client.get_pages(tokens, out), src, ns.block_size
                ),
                "connector load into LBNHC (FlashAttention)": load("LBNHC"),
                "connector load into BLHNC": load("BLHNC"),
                "connector load into BLHNC, blocks in one run": load("BLHNC, one run"),
                "before: staged get_pages (CPU copy+hash, H2D)": lambda: whole(
                    staged.get_pages(tokens, out_staged), src, ns.block_size
                ),
            },
            args.rounds,
            dev,
            errors,
            before=lambda: found.__setitem__(0, client.find(tokens)),
        )
        exact = {
            "baseline": same(dst, ref),
            "get_pages": same(out, ref),
            "staged": same(out_staged, ref),
        }
        exact |= {
            name: same(cache.gather(blocks_of.get(name, ids)).wait(), src)
            for name, cache in paged.items()
        }
        report(
            f"  {label} pages, {n} of them ({nbytes / MiB:.0f} MiB); bit-exact: {', '.join(f'{k} {v}' for k, v in exact.items())}"
        )
        rows(report, times, errors, nbytes)
        if (
            dev.cuda
            and device_checksum.supports(ns.page_nbytes)
            and not device_checksum.available()
        ):
            flat = ref.view(-1).view(torch.uint8)
            offs = [i * ns.page_nbytes for i in range(n)]
            device_checksum.checksums(flat, offs, ns.page_nbytes)
            ts = []
            for _ in range(args.rounds):
                dev.sync()
                t = time.perf_counter()
                device_checksum.checksums(flat, offs, ns.page_nbytes)
                ts.append(time.perf_counter() - t)
            med = statistics.median(ts)
            report(
                f"  device xxh3 alone over the same bytes: {med * 1e3:.2f} ms ({nbytes / med / 1e9:.0f} GB/s)"
            )
        stats = client.stats
        report(
            f"  client counters: device_transfers {stats.device_transfers}, host_registrations {stats.host_registrations}, "
            f"host_register_failures {stats.host_register_failures}, checksum_failures {stats.checksum_failures}, "
            f"slot_reads {stats.slot_reads}, slot_read_misses {stats.slot_read_misses}"
        )
        client.close()
        staged.close()


def section_ucx(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    from kvstore.wire.transport import cuda_capable

    client, src, tokens, ns = stored_pages(
        cluster, dev, SIZES["2 MiB"], args.total, same_host=False
    )
    staged, *_ = stored_pages(
        cluster, dev, SIZES["2 MiB"], 0, same_host=False, transfer_mode="staged"
    )
    import ucxx  # initialised by the client's start, in its loop thread

    version = (
        ".".join(map(str, ucxx.get_ucx_version())) if hasattr(ucxx, "get_ucx_version") else "?"
    )
    report(
        f"  UCX {version}, transports: {', '.join(sorted(ucxx.get_active_transports()))}; cuda transports: {cuda_capable()}"
    )
    report(
        "  a device get over UCX lands in pinned host memory (checked there as it arrives), then one H2D copy"
    )
    ref = src.to(dev.device)
    dst, out, out_staged = torch.empty_like(ref), torch.empty_like(ref), torch.empty_like(ref)
    host_out = torch.empty_like(src)
    systems = {
        "torch pinned H2D copy (baseline)": lambda: dst.copy_(src, non_blocking=True),
        "UCX get_pages into host memory": lambda: whole(
            client.get_pages(tokens, host_out), src, ns.block_size
        ),
        "UCX get_pages into device memory": lambda: whole(
            client.get_pages(tokens, out), src, ns.block_size
        ),
        "before: UCX get_pages, staged -> device": lambda: whole(
            staged.get_pages(tokens, out_staged), src, ns.block_size
        ),
    }
    errors: dict[str, str] = {}
    times = interleave(systems, args.rounds, dev, errors)
    report(
        f"  2 MiB pages, {src.shape[0]}; bit-exact: host {same(host_out, src)}, device {same(out, ref)}, staged {same(out_staged, ref)}"
    )
    rows(report, times, errors, src.numel() * src.element_size())
    client.close()
    staged.close()
