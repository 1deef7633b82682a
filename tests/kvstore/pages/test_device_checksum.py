"""The device xxh3 (kvstore/pages/device_checksum.py) gives xxhash's own digests: its Triton
kernels run on a GPU where there is one, and everywhere in Triton's interpreter on the
CPU. CI installs Triton beside the project, not into it (vLLM's CPU build is kept free
of it: ``TRITON_SITE``, .ci/run); the interpreter runs in a child process with that
folder on its path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvstore.pages import device_checksum
from tests.support.paths import ROOT, TRITON_SITE

# Around every branch of xxh3's long path: one block or less, a partial last block of
# 0, 1 and 15 stripes, a final stripe overlapping the last block, 64 KiB and larger.
SIZES = [248, 1024, 1032, 1088, 2048 + 8, 2048 + 15 * 64 + 8, 24000, 65536, 65536 + 64 + 8, 300_000]

CHILD = r"""
import json, sys
import numpy as np, torch, xxhash
from kvstore.pages import device_checksum
sizes = json.loads(sys.argv[1])
rng = np.random.default_rng(11)
out = []
for nbytes in sizes:
    pages = rng.integers(0, 256, (3, nbytes), dtype=np.uint8)
    base = torch.from_numpy(np.concatenate([np.zeros(8, np.uint8), pages.reshape(-1)]).copy())
    got = device_checksum.checksums(base, [8 + i * nbytes for i in range(3)], nbytes)
    want = [xxhash.xxh3_64_intdigest(p.tobytes()) for p in pages]
    # in segments of at least 5 blocks (an odd count), as a landing checks large pages
    # part by part; the largest page whole only (the interpreter is slow)
    if nbytes > 70_000:
        out.append(got == want)
        continue
    tail = device_checksum.full_blocks(nbytes)
    bounds = sorted({*range(0, tail, max(5, tail // 6 | 1)), tail}) if tail else [0, 0]
    accs = torch.empty((3, 8), dtype=torch.int64)
    offsets = device_checksum.word_offsets([8 + i * nbytes for i in range(3)], nbytes, "cpu")
    for first, end in zip(bounds, bounds[1:]):
        device_checksum.launch(base, offsets, nbytes, out=accs, blocks=(first, end))
    out.append(got == want and device_checksum.finish(accs, nbytes) == want)
out.append(device_checksum.self_test(torch.device("cpu")) is None)  # what a client runs first
print(json.dumps(out))
"""


@pytest.mark.process
def test_the_triton_kernels_give_xxhashs_digests_in_the_interpreter():
    """Whole pages in one launch, and in segments of at least 5 blocks launched in order into
    the same accumulators (the last one adding the partial block and final stripe); the
    self-test a client runs before it trusts the kernels passes."""
    if not (Path(TRITON_SITE) / "triton").is_dir():
        pytest.skip(f"no Triton beside the project at {TRITON_SITE} (.ci/run installs it there)")
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([TRITON_SITE, str(ROOT)])
    )
    res = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(SIZES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [True] * (len(SIZES) + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_triton_kernels_give_xxhashs_digests_on_the_gpu():
    assert device_checksum.available() is None
    rng = np.random.default_rng(5)
    for nbytes in [*SIZES, 2 << 20]:
        pages = rng.integers(0, 256, (5, nbytes), dtype=np.uint8)
        base = torch.from_numpy(pages.reshape(-1).copy()).cuda()
        offsets = [k * nbytes for k in (4, 0, 2)]  # any order, any subset
        assert device_checksum.checksums(base, offsets, nbytes) == [
            xxhash.xxh3_64_intdigest(pages[k].tobytes()) for k in (4, 0, 2)
        ]
    assert device_checksum.self_test(torch.device("cuda")) is None


def test_the_host_merge_matches_xxh3s_final_step():
    """The merge the host runs over the kernels' accumulators (numpy, 64x64->128-bit
    multiplies from 32-bit halves) against Python's exact integers."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 2**64, 1000, dtype=np.uint64)
    y = rng.integers(0, 2**64, 1000, dtype=np.uint64)
    got = device_checksum._mul128_fold(x, y)
    for a, b, g in zip(x.tolist(), y.tolist(), got.tolist()):
        p = a * b
        assert g == (p & (2**64 - 1)) ^ (p >> 64)


def test_large_pages_land_in_segments_that_cover_every_block_once():
    """A page larger than ``SEGMENT_BYTES`` lands in 2 MiB segments; their checks cover
    xxh3's full blocks in order, each once, and the last one reaches the page's end
    (where the partial block and final stripe are added)."""
    from client.memory.device_landing import SEGMENT_BYTES, segments

    assert SEGMENT_BYTES == 2 << 20
    for page in (SEGMENT_BYTES + 8, 3 << 20, 16 << 20, (4 << 20) + 1024):
        parts = segments(page)
        assert sum(width for _, width, _ in parts) == page
        assert [at for at, _, _ in parts] == list(range(0, page, SEGMENT_BYTES))
        bounds = [b for _, _, b in parts]
        assert bounds[0][0] == 0 and bounds[-1][1] == device_checksum.full_blocks(page)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        # a segment's blocks lie inside its bytes (the last one's partial block too)
        assert all(at <= f * 1024 and e * 1024 <= at + width for at, width, (f, e) in parts)
    with pytest.raises(ValueError, match="without out"):
        device_checksum.launch(torch.zeros(4096, dtype=torch.uint8), [0], 4096, blocks=(1, 3))


def test_what_the_device_checks_take_and_refuse():
    assert not device_checksum.supports(240) and device_checksum.supports(248)
    assert not device_checksum.supports(1028)  # not a multiple of 8
    with pytest.raises(ValueError, match="8-byte aligned"):
        device_checksum.launch(torch.zeros(4096, dtype=torch.uint8), [4], 1024)
    assert (
        device_checksum.SECRET[:8] == bytes.fromhex("b8fe6c3923a44bbe")
        and len(device_checksum.SECRET) == 192
    )
    # the secret is xxhash's: a digest needs all of it, so a wrong byte would fail the interpreter test
    assert xxhash.xxh3_64_intdigest(b"") == 0x2D06800538D394C2
