"""What the device-load tests share (test_device_loads.py, test_device_layerwise.py): a
storage node, the copiers they run with (the host as the "device", and CUDA's where a GPU
is), namespaces, and a copier that overwrites a page in the node's memory during a get."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

from client.memory.buffers import Span
from client.memory.device_pages import CudaCopier, DeviceCopier, HostCopier
from client.stats import ClientStats
from kvstore import Namespace
from kvstore.tools.launcher import LocalCluster
from tests.support.helpers import tenant_for

BLOCK = 16
CUDA = torch.cuda.is_available()
COPIERS = {"host": HostCopier} | (
    {"cuda": lambda stats: CudaCopier(torch.device("cuda"), stats)} if CUDA else {}
)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as c:
        yield c


@pytest.fixture(params=list(COPIERS))
def copier(request):
    return request.param


def make_ns(name: str, **over) -> Namespace:
    fields = dict(
        model="device-test",
        dtype="float16",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        block_size=BLOCK,
        tenant=tenant_for(name),
    )
    fields.update(over)
    return Namespace(**fields)


def device_of(copier: str) -> torch.device:
    return torch.device("cuda") if copier == "cuda" else torch.device("cpu")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(
        a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu()
    )


def scribble(span: Span) -> None:
    """Overwrite a page in the node's memory, as the reader maps it: through a writable
    mapping of the same memfd (what a writer of the tenant holds), so the node's slot
    itself changes under the reader."""
    addr, size = span.base.ctypes.data, span.base.nbytes
    fd = os.open(f"/proc/self/map_files/{addr:x}-{addr + size:x}", os.O_RDWR)
    try:
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            view = np.frombuffer(m, dtype=np.uint8)
            view[span.offset : span.offset + span.nbytes : 97] ^= 0x5A
            del view
    finally:
        os.close(fd)


def scribbling(make, page: int):
    """A copier of kind ``make`` that overwrites the ``page``-th page of a get's plan in
    the node's memory once the node has pinned it, just before its copy."""

    def build(stats: ClientStats) -> DeviceCopier:
        inner = make(stats)

        class Scribbling(
            type(inner)
        ):  # the copier under test, with its copy step timed by the test
            def landing(self, rows):
                inner_landing = super().landing(rows)
                add = inner_landing.add

                def scribbled(positions, copies):
                    if len(copies) > page:
                        scribble(copies.source(page))
                    add(positions, copies)

                inner_landing.add = scribbled
                return inner_landing

        inner.__class__ = Scribbling
        return inner

    return build
