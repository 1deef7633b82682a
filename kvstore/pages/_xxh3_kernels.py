"""The Triton kernels of ``kvstore.pages.device_checksum`` (xxh3-64 on the device); a
module of their own because it imports Triton, which only GPU hosts have. Their
algorithm and the host's part are described there."""

# mypy: ignore-errors
# Triton kernels: their arguments are device pointers and compile-time constants, not
# Python types.
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mix(d, key):
    # one stripe lane's product: low half times high half of (data ^ key)
    dk = d ^ key
    return (dk & 0xFFFFFFFF) * (dk >> 32)


# Sizes are not specialised on: one compiled kernel serves every page size (the client
# compiles them once, in its self-test, not in its first load).
@triton.jit(do_not_specialize=["nb", "first"])
def block_sums(words, offsets, keys, sums, nb, first, BPP: tl.constexpr):
    # blocks first to first + nb of each page (a segment of it: all of its full blocks
    # unless its check is queued in parts as it lands), their sums from row 0 of the page's
    page = tl.program_id(0)
    chunk = tl.program_id(1)
    stripe = tl.arange(0, 16)[:, None]
    lane = tl.arange(0, 8)[None, :]
    key = tl.load(keys + stripe + lane).to(tl.uint64, bitcast=True)
    base = tl.load(offsets + page)
    for k in range(BPP):
        b = chunk * BPP + k
        # masks the shape of what they guard (the interpreter takes no scalar mask)
        valid = (b + stripe * 0 + lane * 0) < nb
        at = words + base + (first + b).to(tl.int64) * 128 + stripe * 8
        d = tl.load(at + lane, mask=valid, other=0).to(tl.uint64, bitcast=True)
        swapped = tl.load(at + (lane ^ 1), mask=valid, other=0).to(tl.uint64, bitcast=True)
        add = tl.sum(swapped, axis=0) + tl.sum(mix(d, key), axis=0)
        out = sums + (page.to(tl.int64) * nb + b) * 8 + tl.arange(0, 8)
        tl.store(out, add.to(tl.int64, bitcast=True), mask=(b + tl.arange(0, 8) * 0) < nb)


@triton.jit
def step(acc, add, scramble, prime, inside):
    # one block of one lane: add the block's sums, then xxh3's scramble
    nxt = acc + add.to(tl.uint64, bitcast=True)
    nxt = (nxt ^ (nxt >> 47) ^ scramble) * prime
    return tl.where(inside, nxt, acc)


@triton.jit(do_not_specialize=["n", "nb", "tail", "nstripes", "nwords"])
def chain(
    words,
    offsets,
    keys,
    consts,
    sums,
    accs,
    n,
    nb,
    tail,
    nstripes,
    nwords,
    PAGES: tl.constexpr,
    RESUME: tl.constexpr,
    FINISH: tl.constexpr,
):
    # One thread per (page, lane): xxh3's scramble keeps its 8 lanes apart, so each runs
    # its own chain over the blocks' sums, in registers, with no reduction across threads.
    # A page checked in segments runs its chain a segment a launch: RESUME takes the
    # accumulators the last launch left in accs, FINISH adds the partial block (block
    # ``tail``) and the final stripe.
    col = tl.arange(0, PAGES * 8)
    page = tl.program_id(0) * PAGES + col // 8
    lane = col % 8
    live = page < n
    # consts: 8 initial accumulators, 8 scramble keys, 8 final-stripe keys, the prime
    if RESUME:
        acc = tl.load(accs + page.to(tl.int64) * 8 + lane, mask=live, other=0)
        acc = acc.to(tl.uint64, bitcast=True)
    else:
        acc = tl.load(consts + lane).to(tl.uint64, bitcast=True)
    scramble = tl.load(consts + 8 + lane).to(tl.uint64, bitcast=True)
    last_key = tl.load(consts + 16 + lane).to(tl.uint64, bitcast=True)
    prime = tl.load(consts + 24 + lane * 0).to(tl.uint64, bitcast=True)
    column = sums + page.to(tl.int64) * nb * 8 + lane
    # The blocks' sums are loaded 16 blocks ahead of the chain (p: these 8 blocks, q: the
    # next 8, r and s: the 16 after, loaded as p and q are used), so the chain waits on
    # memory once per 16 blocks, not once a block. Measured on an H200 with a load per
    # block: about 200 ns a block, a 16 MiB page's chain 2.2 ms.
    at = (lane * 0).to(tl.int64)
    p0 = tl.load(column + (at + 0) * 8, mask=live & (lane * 0 + at + 0 < nb), other=0)
    p1 = tl.load(column + (at + 1) * 8, mask=live & (lane * 0 + at + 1 < nb), other=0)
    p2 = tl.load(column + (at + 2) * 8, mask=live & (lane * 0 + at + 2 < nb), other=0)
    p3 = tl.load(column + (at + 3) * 8, mask=live & (lane * 0 + at + 3 < nb), other=0)
    p4 = tl.load(column + (at + 4) * 8, mask=live & (lane * 0 + at + 4 < nb), other=0)
    p5 = tl.load(column + (at + 5) * 8, mask=live & (lane * 0 + at + 5 < nb), other=0)
    p6 = tl.load(column + (at + 6) * 8, mask=live & (lane * 0 + at + 6 < nb), other=0)
    p7 = tl.load(column + (at + 7) * 8, mask=live & (lane * 0 + at + 7 < nb), other=0)
    q0 = tl.load(column + (at + 8) * 8, mask=live & (lane * 0 + at + 8 < nb), other=0)
    q1 = tl.load(column + (at + 9) * 8, mask=live & (lane * 0 + at + 9 < nb), other=0)
    q2 = tl.load(column + (at + 10) * 8, mask=live & (lane * 0 + at + 10 < nb), other=0)
    q3 = tl.load(column + (at + 11) * 8, mask=live & (lane * 0 + at + 11 < nb), other=0)
    q4 = tl.load(column + (at + 12) * 8, mask=live & (lane * 0 + at + 12 < nb), other=0)
    q5 = tl.load(column + (at + 13) * 8, mask=live & (lane * 0 + at + 13 < nb), other=0)
    q6 = tl.load(column + (at + 14) * 8, mask=live & (lane * 0 + at + 14 < nb), other=0)
    q7 = tl.load(column + (at + 15) * 8, mask=live & (lane * 0 + at + 15 < nb), other=0)
    for start in range(0, nb, 16):
        at = (lane * 0).to(tl.int64) + start
        r0 = tl.load(column + (at + 16) * 8, mask=live & (lane * 0 + at + 16 < nb), other=0)
        r1 = tl.load(column + (at + 17) * 8, mask=live & (lane * 0 + at + 17 < nb), other=0)
        r2 = tl.load(column + (at + 18) * 8, mask=live & (lane * 0 + at + 18 < nb), other=0)
        r3 = tl.load(column + (at + 19) * 8, mask=live & (lane * 0 + at + 19 < nb), other=0)
        r4 = tl.load(column + (at + 20) * 8, mask=live & (lane * 0 + at + 20 < nb), other=0)
        r5 = tl.load(column + (at + 21) * 8, mask=live & (lane * 0 + at + 21 < nb), other=0)
        r6 = tl.load(column + (at + 22) * 8, mask=live & (lane * 0 + at + 22 < nb), other=0)
        r7 = tl.load(column + (at + 23) * 8, mask=live & (lane * 0 + at + 23 < nb), other=0)
        s0 = tl.load(column + (at + 24) * 8, mask=live & (lane * 0 + at + 24 < nb), other=0)
        s1 = tl.load(column + (at + 25) * 8, mask=live & (lane * 0 + at + 25 < nb), other=0)
        s2 = tl.load(column + (at + 26) * 8, mask=live & (lane * 0 + at + 26 < nb), other=0)
        s3 = tl.load(column + (at + 27) * 8, mask=live & (lane * 0 + at + 27 < nb), other=0)
        s4 = tl.load(column + (at + 28) * 8, mask=live & (lane * 0 + at + 28 < nb), other=0)
        s5 = tl.load(column + (at + 29) * 8, mask=live & (lane * 0 + at + 29 < nb), other=0)
        s6 = tl.load(column + (at + 30) * 8, mask=live & (lane * 0 + at + 30 < nb), other=0)
        s7 = tl.load(column + (at + 31) * 8, mask=live & (lane * 0 + at + 31 < nb), other=0)
        acc = step(acc, p0, scramble, prime, lane * 0 + at + 0 < nb)
        acc = step(acc, p1, scramble, prime, lane * 0 + at + 1 < nb)
        acc = step(acc, p2, scramble, prime, lane * 0 + at + 2 < nb)
        acc = step(acc, p3, scramble, prime, lane * 0 + at + 3 < nb)
        acc = step(acc, p4, scramble, prime, lane * 0 + at + 4 < nb)
        acc = step(acc, p5, scramble, prime, lane * 0 + at + 5 < nb)
        acc = step(acc, p6, scramble, prime, lane * 0 + at + 6 < nb)
        acc = step(acc, p7, scramble, prime, lane * 0 + at + 7 < nb)
        acc = step(acc, q0, scramble, prime, lane * 0 + at + 8 < nb)
        acc = step(acc, q1, scramble, prime, lane * 0 + at + 9 < nb)
        acc = step(acc, q2, scramble, prime, lane * 0 + at + 10 < nb)
        acc = step(acc, q3, scramble, prime, lane * 0 + at + 11 < nb)
        acc = step(acc, q4, scramble, prime, lane * 0 + at + 12 < nb)
        acc = step(acc, q5, scramble, prime, lane * 0 + at + 13 < nb)
        acc = step(acc, q6, scramble, prime, lane * 0 + at + 14 < nb)
        acc = step(acc, q7, scramble, prime, lane * 0 + at + 15 < nb)
        p0, p1, p2, p3, p4, p5, p6, p7 = r0, r1, r2, r3, r4, r5, r6, r7
        q0, q1, q2, q3, q4, q5, q6, q7 = s0, s1, s2, s3, s4, s5, s6, s7
    if FINISH:
        # the last, partial block: its first nstripes stripes, no scramble after them
        base = tl.load(offsets + page, mask=live, other=0)
        at = words + base + tail.to(tl.int64) * 128
        for s in tl.static_range(16):
            m = live & ((lane * 0 + s) < nstripes)
            d = tl.load(at + s * 8 + lane, mask=m, other=0).to(tl.uint64, bitcast=True)
            swapped = tl.load(at + s * 8 + (lane ^ 1), mask=m, other=0)
            swapped = swapped.to(tl.uint64, bitcast=True)
            key = tl.load(keys + s + lane).to(tl.uint64, bitcast=True)
            acc = tl.where(m, acc + swapped + mix(d, key), acc)
        # the final stripe: the page's last 64 bytes (they may overlap the stripes before)
        end = words + base + nwords - 8
        d = tl.load(end + lane, mask=live, other=0).to(tl.uint64, bitcast=True)
        swapped = tl.load(end + (lane ^ 1), mask=live, other=0).to(tl.uint64, bitcast=True)
        acc += swapped + mix(d, last_key)
    tl.store(accs + page.to(tl.int64) * 8 + lane, acc.to(tl.int64, bitcast=True), mask=live)
