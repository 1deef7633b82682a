"""The Triton kernel of ``client.paging.gather_pages``: copy blocks of every layer of a
paged KV cache into page-major rows in one launch, or rows into blocks (``TO_CACHE``); a module of its own because it
imports Triton, which only GPU hosts have."""

# mypy: ignore-errors
# Triton kernels: their arguments are device pointers and compile-time constants, not
# Python types.
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(
    do_not_specialize=["out_at", "layers", "inner", "b_inner", "s_blk", "s_h", "s_b", "s_c"]
)
def gather(
    anchor,
    layer_at,
    blocks,
    out_at,
    layers,
    inner,
    b_inner,
    s_blk,
    s_h,
    s_b,
    s_c,
    C: tl.constexpr,
    ROW: tl.constexpr,
    TO_CACHE: tl.constexpr,
):
    # program (page i, layer l, chunk): element e of the page's layer part, in page order
    # [heads, block, C], read from the layer's own strides. Every address is ``anchor``
    # (layer 0's first element) plus elements: the layers' and the rows' offsets from it.
    pid = tl.program_id(0)
    i = pid // layers
    layer = pid % layers
    e = tl.program_id(1) * ROW + tl.arange(0, ROW)
    inside = e < inner
    h = e // b_inner
    b = (e // C) % (b_inner // C)
    c = e % C
    block = tl.load(blocks + i)
    src = tl.load(layer_at + layer) + block * s_blk + h * s_h + b * s_b + c * s_c
    row = out_at + (i * layers + layer).to(tl.int64) * inner + e
    if TO_CACHE:  # the other way: the rows into the blocks (a load's scatter)
        tl.store(anchor + src, tl.load(anchor + row, mask=inside), mask=inside)
    else:
        tl.store(anchor + row, tl.load(anchor + src, mask=inside), mask=inside)
