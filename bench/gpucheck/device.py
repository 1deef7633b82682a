"""What the GPU check's sections share on the device: ``Dev`` (the device and its streams),
bit-exact comparison, the interleaved timing loop, and the pages a section stores and loads
back (``stored_pages``, ``caches``). Imports torch: bench/gpu_check.py imports it (through
bench/gpucheck/sections.py) only once the carried wheels are on the path."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpucheck.report import MiB

LLAMA_KV = {"num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"}
SIZES = {
    "64 KiB": {"num_layers": 1, "block_size": 16},
    "2 MiB": {"num_layers": 32, "block_size": 16},
    "16 MiB": {"num_layers": 32, "block_size": 128},
}


class Dev:
    """The device and its streams; on CPU there is one stream and waits do nothing."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.device = cuda, torch.device("cuda" if cuda else "cpu")

    def sync(self, compute_only: bool = False) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize() if compute_only else torch.cuda.synchronize()

    def stream(self) -> Any:
        return torch.cuda.Stream() if self.cuda else None

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def event(self, stream: Any = None) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, event: Any, stream: Any = None) -> None:
        if event is not None:
            (stream or torch.cuda.current_stream()).wait_event(event)

    def host(self, shape: tuple[int, ...], dtype: Any, random: bool = False) -> Any:
        t = torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
        if random:
            t.view(torch.uint8).copy_(
                torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8)
            )
        return t


def same(a: Any, b: Any) -> bool:
    """Bit-exact (NaN payloads included), wherever the two live."""
    return torch.equal(
        a.contiguous().view(torch.uint8).reshape(-1).cpu(),
        b.contiguous().view(torch.uint8).reshape(-1).cpu(),
    )


def interleave(
    systems: dict[str, Callable[[], Any]],
    rounds: int,
    dev: Dev,
    errors: dict[str, str],
    before: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each system per round, A B C A B C, after a warm-up round; a system that
    raises is dropped, its error kept in ``errors``."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(rounds + 1):
        if before:
            before()
        for name, fn in systems.items():
            if name in errors:
                continue
            dev.sync()
            start = time.perf_counter()
            try:
                fn()
                dev.sync()
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            if r:
                times[name].append(time.perf_counter() - start)
    return times


def stored_pages(
    cluster: Any, dev: Dev, shape: dict, total: int, layout: str = "vllm_cpu", **options: Any
) -> tuple[Any, Any, list[int], Any]:
    """A client, ``total`` bytes of random pages it put (vLLM 0.32's connector view,
    ``[layers, heads, block, 2*head_size]``, on every backend), their tokens, the namespace.
    ``_shape`` (an option): the namespace's geometry in full, and ``total`` its pages."""
    from client import KVCacheClient
    from kvstore.pages.namespace import Namespace

    fields = options.pop("_shape", None)
    ns = Namespace(
        model="gpu-check", layout=layout, tenant="gpucheck", **(fields or {**LLAMA_KV, **shape})
    )
    n = total if fields else max(2, total // ns.page_nbytes)
    client = KVCacheClient(
        cluster.redis_url,
        ns,
        timeout=60,
        host_buffer_bytes=max(64 * MiB, 2 * n * ns.page_nbytes),
        **options,
    )
    src = dev.host((n, *ns.page_shape), ns.torch_dtype(), random=True)
    tokens = torch.randint(0, 2**31, (n * ns.block_size,)).tolist()
    if (stored := client.put_pages(tokens, src).stored) != n:
        raise RuntimeError(f"the store kept {stored} of {n} pages")
    return client, src, tokens, ns


def whole(got: int, src: Any, block_size: int) -> None:
    if got != src.shape[0] * block_size:
        raise RuntimeError(f"got {got // block_size} of {src.shape[0]} pages")


def caches(ns: Any, blocks: int, dev: Dev) -> dict[str, Any]:
    """vLLM 0.32's per-layer views ``[blocks, heads, block, 2*head_size]`` over the two
    byte orders that matter: LBNHC (FlashAttention's default: per layer, token-major
    inside a block) and BLHNC (one block of every layer contiguous: one kvstore page)."""
    from client.paging.paged_cache import PagedCache

    L, H, B, C = ns.page_shape
    dt = ns.torch_dtype()
    lbnhc = [
        torch.zeros((blocks, B, H, C), dtype=dt, device=dev.device).permute(0, 2, 1, 3)
        for _ in range(L)
    ]
    blhnc = torch.zeros((blocks, L, H, B, C), dtype=dt, device=dev.device)
    run = torch.zeros((blocks, L, H, B, C), dtype=dt, device=dev.device)
    return {
        "LBNHC": PagedCache(lbnhc),
        "BLHNC": PagedCache([blhnc[:, layer] for layer in range(L)]),
        "BLHNC, one run": PagedCache([run[:, layer] for layer in range(L)]),
    }
