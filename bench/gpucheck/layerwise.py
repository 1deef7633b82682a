"""Section 3 of the GPU check (bench/gpu_check.py): layer-wise loading against a synthetic
Llama-8B forward, time to first token; ``llama`` is section 4's model too."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from bench.gpucheck.device import Dev, caches, interleave, same, stored_pages
from bench.gpucheck.report import MiB, Report, rows


def llama(dev: Dev) -> tuple[dict[str, Any], Callable[[Any], Any]]:
    """Llama-3-8B's dimensions (toy ones on CPU) and one layer's matmuls: the same weights
    for every layer (a layer's 436 MB fit no cache, so each layer reads them again)."""
    d: dict[str, Any] = {
        "layers": 32,
        "tokens": 4096,
        "hidden": 4096,
        "inter": 14336,
        "heads": 8,
        "head": 128,
        "block": 16,
        "batch": 64,
    }
    if not dev.cuda:
        d.update(layers=4, tokens=128, hidden=256, inter=896, heads=2, head=64, batch=8)
    d["dtype"] = torch.bfloat16 if dev.cuda else torch.float32
    h, i, kv = d["hidden"], d["inter"], 2 * d["heads"] * d["head"]
    w = {
        k: torch.randn(s, dtype=d["dtype"], device=dev.device) * 0.02
        for k, s in {"qkv": (h, h + kv), "o": (h, h), "up": (h, 2 * i), "down": (i, h)}.items()
    }

    def layer(x: Any) -> Any:
        x = x + (x @ w["qkv"])[:, :h] @ w["o"]
        up = x @ w["up"]
        return x + (torch.nn.functional.silu(up[:, :i]) * up[:, i:]) @ w["down"]

    return d, layer


def connector_load(
    dev: Dev, cluster: Any, d: dict[str, Any]
) -> tuple[
    Callable[[], None], Callable[[Callable[[Callable[[int], Any]], Any]], None], Callable[[], None]
]:
    """The KV of ``d``'s prompt stored as pages, and two ways to load all of it through
    the connector's load paths into an LBNHC cache: whole (``PageLoader.load``: on a GPU,
    pages straight from the node's memory into device rows, checked, scattered), and
    layer by layer beside a forward pass (``LayerwiseLoads``: the forward's wait for
    layer i makes its stream wait for that layer's copies and scatters it), which checks
    once that the cache holds the stored pages bit-exact."""
    from concurrent.futures import ThreadPoolExecutor

    from client.paging.layerwise import LayerwiseLoads
    from client.paging.loader import PageLoader
    from client.paging.staging_pool import StagingPool
    from client.vllm.metadata import LoadSpec

    shape = {
        "num_layers": d["layers"],
        "block_size": d["block"],
        "num_kv_heads": d["heads"],
        "head_size": d["head"],
        "dtype": "bfloat16" if d["dtype"] == torch.bfloat16 else "float32",
    }
    from client.memory.device_pages import HostCopier

    on_cpu = {} if dev.cuda else {"device": HostCopier}  # a dry run: the host as the device
    client, src, tokens, ns = stored_pages(
        cluster, dev, {}, d["tokens"] // d["block"], layout="vllm_cpu", _shape=shape, **on_cpu
    )
    n = src.shape[0]
    cache = caches(ns, n + 8, dev)["LBNHC"]
    loader = PageLoader(
        client,
        cache,
        StagingPool(cache, 1, n),
        block_size=ns.block_size,
        layer_groups=[],
        load_stream=dev.stream(),
        credential_refused=lambda exc: None,
    )
    ids = list(range(4, 4 + n))

    def run() -> None:
        outcome = loader.load(LoadSpec("r", client.find(tokens), ids, 0), None)
        if outcome.failed:
            raise RuntimeError(f"{len(outcome.failed)} blocks failed")

    names = [f"layers.{i}" for i in range(d["layers"])]
    pool = ThreadPoolExecutor(2)
    loads = LayerwiseLoads(
        loader,
        cache,
        pool,
        lambda spec, after: loader.load(spec, after),
        feeds=True,
        timeout=60,
        layer_index={name: i for i, name in enumerate(names)},
    )
    if not loader.feeds_layers:
        raise RuntimeError("the connector cannot load layer by layer here (no 2-D copies?)")
    checked: list[bool] = []

    def layered(forward: Callable[[Callable[[int], Any]], Any]) -> None:
        loads.start(LoadSpec("r", client.find(tokens), ids, 0, layerwise=True), None)
        forward(lambda i: loads.wait_layer(names[i]))
        ((_, outcome),) = loads.finish()
        if outcome.failed:
            raise RuntimeError(f"{len(outcome.failed)} blocks failed")
        if not checked:  # once: every layer of every block is the stored page's
            dev.sync()
            index = torch.tensor(ids, device=dev.device)
            checked.append(
                all(
                    same(cache.layers[i].index_select(0, index), src[:, i])
                    for i in range(d["layers"])
                )
            )
            if not checked[0]:
                raise RuntimeError("the layer-wise load is not bit-exact")

    def close() -> None:  # its slabs' registrations go with the client (as an engine's would)
        pool.shutdown()
        client.close()

    return run, layered, close


def section_layerwise(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    d, layer = llama(dev)
    L, shape = d["layers"], (2, d["tokens"] // d["block"], d["block"], d["heads"], d["head"])
    host = [dev.host(shape, d["dtype"], random=True) for _ in range(L)]
    cache = [torch.zeros(shape, dtype=d["dtype"], device=dev.device) for _ in range(L)]
    x0 = torch.randn((d["tokens"], d["hidden"]), dtype=d["dtype"], device=dev.device)
    side, probes = dev.stream(), torch.zeros((L,), dtype=d["dtype"], device=dev.device)

    def load(i: int) -> Any:
        with dev.on(side):
            cache[i].copy_(host[i], non_blocking=True)
        return dev.event(side)

    def forward(wait: Callable[[int], Any]) -> Any:
        x = x0
        for i in range(L):
            wait(i)
            probes[i] = cache[i].view(-1)[-1]  # what this layer saw of its KV (checked below)
            x = layer(x)
        return x

    def all_first() -> Any:  # (a) the request waits for its whole load (the connector today)
        for i in range(L):
            load(i)
        if side is not None:
            side.synchronize()
        return forward(lambda i: None)

    def one_ahead() -> Any:  # (b) the compute stream waits for each layer's event
        events = {0: load(0)}

        def wait(i: int) -> None:
            if i + 1 < L:
                events[i + 1] = load(i + 1)
            dev.wait(events[i])

        return forward(wait)

    def vllm_shape() -> Any:  # (c) start_load_kv issues all; wait_for_layer_load blocks the host
        events = [load(i) for i in range(L)]
        return forward(lambda i: events[i] is not None and events[i].synchronize())

    ways = {
        "(a) load all, then compute (baseline)": all_first,
        "(b) load layer i+1 during layer i": one_ahead,
        "(c) vLLM wait_for_layer_load shape": vllm_shape,
        "compute only (no KV load)": lambda: forward(lambda i: None),
        "KV load only": lambda: [load(i) for i in range(L)],
    }
    if cluster is not None:  # the same KV from the store, through the connector's loads
        store, layered, close = connector_load(dev, cluster, d)
        ways["(d) connector load from the store, then compute"] = lambda: (
            store(),
            forward(lambda i: None),
        )
        ways["(e) connector layer-wise load, in the forward"] = lambda: layered(forward)
        ways["connector load from the store only"] = store
    ordered, last = {}, torch.stack([h.view(-1)[-1] for h in host])
    for name in list(ways)[:3]:  # on zeroed caches: did each layer run after its KV was in place?
        for kv in cache:
            kv.zero_()
        dev.sync()
        ways[name]()
        dev.sync()
        ordered[name[:3]] = same(probes, last) and all(same(c, h) for c, h in zip(cache, host))
    errors: dict[str, str] = {}
    try:
        times = interleave(ways, args.rounds, dev, errors)
    finally:
        if cluster is not None:
            close()
    kv_mib = sum(h.numel() * h.element_size() for h in host) / MiB
    report(
        f"  {L} layers, {d['tokens']} tokens, hidden {d['hidden']}, {kv_mib:.1f} MiB of KV from pinned memory; "
        f"each layer saw its whole KV: {', '.join(f'{k} {v}' for k, v in ordered.items())}"
    )
    report("  time to first token (end of the forward):")
    rows(report, times, errors)
