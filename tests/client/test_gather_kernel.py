"""The GPU save's one-launch copy of a request's blocks out of every layer, and a load's
the other way (client/paging/gather_pages.py), give each page's bytes exactly, for every byte order a
vLLM backend may give the per-layer view: in Triton's interpreter on the CPU here (a
child process with CI's Triton folder on its path, as tests/kvstore/pages/test_device_checksum.py),
and through ``PagedCache.gather`` on CUDA in tests/client/test_paged_cache.py where a GPU is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT, TRITON_SITE

pytestmark = pytest.mark.process  # every test here starts a node or a Python process

CHILD = r"""
import itertools, torch
from client.paging.gather_pages import LayerGather, why_not
L, NB, H, B, C = 3, 20, 2, 4, 6
ok = []
for order in itertools.permutations(range(4)):
    layers = []
    for _ in range(L):
        phys = torch.randint(-30000, 30000, [(NB, H, B, C)[i] for i in order], dtype=torch.int16).view(torch.bfloat16)
        layers.append(phys.permute(*[order.index(i) for i in range(4)]))
    assert why_not(layers) is None
    ids = [5, 3, 17, 4, 0, 19]
    out = torch.empty((len(ids), L, H, B, C), dtype=torch.bfloat16)
    LayerGather(layers)(ids, out)
    ok.append(torch.equal(out.view(torch.int16), torch.stack([kv[ids] for kv in layers], 1).contiguous().view(torch.int16)))
    # the other way: pages into the blocks, every other block untouched
    before = [kv.clone() for kv in layers]
    pages = torch.randint(-30000, 30000, out.shape, dtype=torch.int16).view(torch.bfloat16)
    copier = LayerGather(layers)
    assert copier.takes(pages) and not copier.takes(pages[:, :1]) and not copier.takes(pages.float())
    copier.scatter(ids, pages)
    rest = [b for b in range(NB) if b not in ids]
    ok.append(all(
        torch.equal(kv[ids].view(torch.int16), pages[:, i].view(torch.int16))
        and torch.equal(kv[rest].view(torch.int16), old[rest].view(torch.int16))
        for i, (kv, old) in enumerate(zip(layers, before))
    ))
mixed = [torch.zeros((NB, H, B, C)), torch.zeros((NB, B, H, C)).permute(0, 2, 1, 3)]
print(sum(ok), len(ok), why_not(mixed))
"""


def test_the_gather_kernel_copies_every_layout_both_ways_in_the_interpreter():
    if not (Path(TRITON_SITE) / "triton").is_dir():
        pytest.skip(f"no Triton beside the project at {TRITON_SITE} (.ci/run installs it there)")
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([TRITON_SITE, str(ROOT)])
    )
    res = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["48", "48", "the", "layers'", "strides", "or", "dtypes", "differ"]
