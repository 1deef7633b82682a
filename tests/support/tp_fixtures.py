"""Helpers of the tensor-parallel tests: a rank's namespace, rank processes run side by
side, and two storage nodes for a module."""

from __future__ import annotations

import json

import pytest

from kvstore import Namespace
from kvstore.tools.launcher import LocalCluster
from tests.support.helpers import run_worker, spec

HEADS = 4
TOKENS = list(range(8 * 16))  # 8 blocks of 16 tokens


def rank_ns(
    tp_size: int,
    tp_rank: int,
    *,
    heads: int = HEADS,
    groups: int = 2,
    layout: str = "kv_lbhd",
    tenant: str = "tp",
) -> Namespace:
    """The namespace of one rank of an engine at ``tp_size`` (vLLM's head split)."""
    replicated = tp_size > heads
    return Namespace(
        model="tp-share",
        dtype="float16",
        num_layers=2,
        head_size=16,
        block_size=16,
        layout=layout,
        hidden_size=32,
        num_kv_heads=1 if replicated else heads // tp_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=heads if replicated else 0,
        head_groups=groups,
        tenant=tenant,
    )


def _result(proc) -> dict:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def run_ranks(cluster, tp_size: int, op: str, ns_kw: dict | None = None, **kw) -> list[dict]:
    """Run ``op`` in one process per rank of an engine at ``tp_size``, all at once."""
    procs = [
        run_worker(
            spec(cluster, rank_ns(tp_size, r, **(ns_kw or {})), op, kv="model", **kw),
            background=True,
        )
        for r in range(tp_size)
    ]
    return [_result(p) for p in procs]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(servers=2, capacity="128MiB", slab_size="4MiB") as c:
        yield c
