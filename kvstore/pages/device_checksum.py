"""Page checksums computed on the GPU: the same 64-bit xxh3 as ``kvstore.pages.checksum``
(xxhash's ``xxh3_64``, seed 0), over pages that already lie in device memory.

Who calls it: the client's device loads (``client.memory.device_pages``). Pages are copied from
a node's registered memory into device memory by DMA, with no CPU copy and no CPU hash;
this checks the bytes that landed against the index's checksum, so "never wrong KV"
holds off the copy path: a page evicted, overwritten or scribbled on while it was being
copied fails its check and becomes a miss.

XXH3 over more than 240 bytes runs 8 accumulators over 1 KiB blocks: each block adds the
products of its 16 stripes (sums mod 2**64: order-free, so parallel) and then scrambles
the accumulators (a multiply: a chain from block to block). So two kernels:

1. ``_block_sums``: every full block of every page in parallel, the 8 words it adds
   (reads each page once; writes 64 bytes per KiB).
2. ``_chain``: one program per page runs the scramble chain over those sums, 8 blocks a
   step with their loads issued together, then adds the last partial block and the
   final stripe; the 8 accumulators go back to the host, which merges them (``merge``,
   numpy over all pages at once: a 64x64->128-bit multiply per pair).

Pages of 240 bytes or fewer (xxh3's short-input paths; no KV page is that small) and
pages whose length or offset is not a multiple of 8 are not handled (``supports``).
Needs Triton (``available`` says why not); tests run the kernels in Triton's
interpreter on the CPU (``TRITON_INTERPRET=1``) against xxhash."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

# xxh3's default 192-byte secret (xxhash.h: XXH3_kSecret), checked against xxhash's own
# digests by the tests and by ``self_test``.
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_M = (1 << 64) - 1
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64 = (
    0x9E3779B185EBCA87,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0x85EBCA77C2B2AE63,
    0x27D4EB2F165667C5,
)
_INIT = (_P32_3, _P64[0], _P64[1], _P64[2], _P64[3], _P32_2, _P64[4], _P32_1)
BLOCK = 1024  # bytes of one xxh3 block: 16 stripes of 64 bytes
MIN_BYTES = 241  # shorter inputs take xxh3's other paths


def _words(offset: int, count: int) -> list[int]:
    """``count`` little-endian u64 words of the secret from byte ``offset`` (unaligned
    offsets too: the final stripe's key starts at byte 121, the merge's at 11)."""
    return [
        int.from_bytes(SECRET[offset + 8 * i : offset + 8 * i + 8], "little") for i in range(count)
    ]


_STRIPE_KEYS = _words(0, 24)  # stripe s, lane l reads word s + l
_SCRAMBLE_KEYS = _words(128, 8)
_LAST_KEYS = _words(121, 8)
_MERGE_KEYS = _words(11, 8)


def supports(nbytes: int) -> bool:
    """Whether pages of ``nbytes`` bytes can be checked on the device."""
    return nbytes >= MIN_BYTES and nbytes % 8 == 0


@functools.lru_cache(maxsize=1)
def _triton() -> tuple[Any, Any] | str:
    """(triton, triton.language), or why they cannot be used."""
    try:
        import triton
        import triton.language as tl
    except Exception as exc:  # any import failure means "not here"
        return f"triton does not import: {type(exc).__name__}: {exc}"
    return triton, tl


def available() -> str | None:
    """None when device checksums can run here, else why not."""
    got = _triton()
    return got if isinstance(got, str) else None


@functools.lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any]:
    """The two Triton kernels (``kvstore.pages._xxh3_kernels``, which imports Triton)."""
    why = available()
    if why:
        raise RuntimeError(why)
    from kvstore.pages import _xxh3_kernels

    return _xxh3_kernels.block_sums, _xxh3_kernels.chain


def _signed(values: list[int]) -> list[int]:
    return [v - (1 << 64) if v >= 1 << 63 else v for v in values]


@functools.lru_cache(maxsize=8)
def _tables(device: Any) -> tuple[Any, Any]:
    """The secret's stripe keys and the chain's constants as int64 tensors on ``device``."""
    import torch

    keys = torch.tensor(_signed(_STRIPE_KEYS), dtype=torch.int64, device=device)
    consts = _signed([*_INIT, *_SCRAMBLE_KEYS, *_LAST_KEYS, _P32_1])
    return keys, torch.tensor(consts, dtype=torch.int64, device=device)


def _mul128_fold(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Low 64 bits xor high 64 bits of each 128-bit product (xxhash's mul128_fold64)."""
    lo32 = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    xl, xh, yl, yh = x & lo32, x >> s32, y & lo32, y >> s32
    ll, hl, lh, hh = xl * yl, xh * yl, xl * yh, xh * yh
    cross = (ll >> s32) + (hl & lo32) + lh
    upper = (hl >> s32) + (cross >> s32) + hh
    lower = (cross << s32) | (ll & lo32)
    return lower ^ upper


_EVEN_KEYS = np.array(_MERGE_KEYS[0::2], dtype=np.uint64)
_ODD_KEYS = np.array(_MERGE_KEYS[1::2], dtype=np.uint64)


def merge(accs: np.ndarray, nbytes: int) -> np.ndarray:
    """xxh3's final merge and avalanche of each row of accumulators ``[pages, 8]``
    (uint64, downloaded from ``launch``'s): the pages' digests (uint64). The four lane
    pairs of every row at once (a get waits for this after its last copy: one pass
    per pair cost about 0.1 ms more on an H200 host)."""
    with np.errstate(over="ignore"):
        folds = _mul128_fold(accs[:, 0::2] ^ _EVEN_KEYS, accs[:, 1::2] ^ _ODD_KEYS)
        h = folds.sum(axis=1, dtype=np.uint64) + np.uint64((nbytes * _P64[0]) & _M)
        h ^= h >> np.uint64(37)
        h = h * np.uint64(0x165667919E3779F9)
        h ^= h >> np.uint64(32)
    return h


# Blocks one program of ``_block_sums`` takes (more past 65,535 programs a page, the
# grid's limit), and blocks the chain loads at once.
BLOCKS_PER_PROGRAM = 16
CHAIN_PAGES = 4  # pages (of 8 lanes each) one program of ``_chain`` runs: one warp


def word_offsets(offsets: Sequence[int] | np.ndarray, nbytes: int, device: Any) -> Any:
    """The pages' offsets in ``base`` (bytes) as the kernels take them: an int64 tensor of
    8-byte words on ``device``, uploaded on the current stream from pinned memory (a
    pageable upload would wait for the stream's earlier work). A caller that checks
    pages in batches uploads them once."""
    import torch

    at = np.asarray(offsets, dtype=np.int64)
    if not supports(nbytes) or (at % 8).any():
        raise ValueError(
            f"device checksums need pages of at least {MIN_BYTES} bytes, 8-byte aligned"
        )
    words = torch.from_numpy(at // 8)
    if torch.device(device).type == "cuda":
        words = words.pin_memory()
    return words.to(device, non_blocking=True)


def full_blocks(nbytes: int) -> int:
    """The 1 KiB blocks of a page of ``nbytes`` that xxh3 scrambles after: every one but
    the last, which is partial or whole (the final stripe's)."""
    return (nbytes - 1) // BLOCK


def launch(
    base: Any, offsets: Any, nbytes: int, out: Any = None, blocks: tuple[int, int] | None = None
) -> Any:
    """Queue, on the current stream, the xxh3 of each page of ``nbytes`` bytes that starts
    ``offsets[i]`` bytes into ``base`` (a contiguous uint8 tensor on the device: every
    offset and ``nbytes`` multiples of 8, ``supports(nbytes)``); ``offsets`` as a list,
    or as ``word_offsets`` gave them. Returns the pages' accumulators ``[pages, 8]``
    (int64, on the device; ``out`` when given) for ``finish``. The caller keeps
    ``base``'s bytes in place until then. With ``blocks`` (``(first, end)``, of
    ``full_blocks(nbytes)``), only that segment of each page, read from bytes ``first *
    BLOCK`` on (and, at the end, the rest of the page): a caller checking pages part by
    part as they land queues the segments in order into the same ``out``."""
    import torch

    device = base.device
    if not isinstance(offsets, torch.Tensor):
        offsets = word_offsets(offsets, nbytes, device)
    elif not supports(nbytes):
        raise ValueError(f"device checksums need pages of at least {MIN_BYTES} bytes")
    tail = full_blocks(nbytes)
    first, end = (0, tail) if blocks is None else blocks
    if not 0 <= first <= end <= tail or (first and out is None):
        raise ValueError(f"blocks {first} to {end} of {tail}, or a later segment without out")
    block_sums, chain = _kernels()
    words = base.view(torch.int64)
    n = len(offsets)
    nb = end - first
    nstripes = ((nbytes - 1) - BLOCK * tail) // 64
    keys, consts = _tables(device)
    sums = torch.empty((max(n * nb, 1), 8), dtype=torch.int64, device=device)
    accs = torch.empty((max(n, 1), 8), dtype=torch.int64, device=device) if out is None else out
    if n:
        per = max(BLOCKS_PER_PROGRAM, -(-nb // 65535))
        if nb:
            block_sums[(n, -(-nb // per))](words, offsets, keys, sums, nb, first, BPP=per)
        chain[(-(-n // CHAIN_PAGES),)](
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
            nbytes // 8,
            PAGES=CHAIN_PAGES,
            RESUME=first > 0,
            FINISH=end == tail,
            num_warps=1,
        )
    return accs[:n]


def finish(accs: Any, nbytes: int) -> list[int]:
    """The digests of the pages ``launch`` queued (waits for the kernels)."""
    host = accs.cpu().numpy().view(np.uint64)
    return merge(host.reshape(-1, 8), nbytes).tolist() if len(host) else []


def checksums(base: Any, offsets: list[int], nbytes: int) -> list[int]:
    """xxh3-64 of each page (``launch`` then ``finish``): equal to
    ``kvstore.pages.checksum.page_checksum`` of the same bytes."""
    return finish(launch(base, offsets, nbytes), nbytes)


def self_test(device: Any) -> str | None:
    """None when the kernels give xxhash's digests on ``device``, else why not (checked
    once before a client trusts them: a miscompiled kernel would turn every load into a
    miss, never into wrong KV, but should be said once rather than counted forever)."""
    import torch

    from kvstore.pages.checksum import page_checksum

    why = available()
    if why:
        return why
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    try:
        for nbytes in (248, 1024, 1032, 4096 + 64 + 8, 65536):
            pages = rng.integers(0, 256, (3, nbytes), dtype=np.uint8)
            base = torch.from_numpy(pages.reshape(-1).copy()).to(device)
            got = checksums(base, [0, nbytes, 2 * nbytes], nbytes)
            want = [page_checksum(p) for p in pages]
            if got != want:
                return f"device xxh3 of {nbytes}-byte pages differs from xxhash's"
        # in segments, as a landing checks large pages (its kernels' other variants)
        nbytes, tail = 65536 + 72, full_blocks(65536 + 72)
        pages = rng.integers(0, 256, (2, nbytes), dtype=np.uint8)
        base = torch.from_numpy(pages.reshape(-1).copy()).to(device)
        accs = torch.empty((2, 8), dtype=torch.int64, device=device)
        for blocks in ((0, 21), (21, 40), (40, tail)):
            launch(base, [0, nbytes], nbytes, accs, blocks)
        if finish(accs, nbytes) != [page_checksum(p) for p in pages]:
            return "device xxh3 in segments differs from xxhash's"
    except Exception as exc:  # a kernel that fails to build or run is a reason
        return f"device xxh3 failed: {type(exc).__name__}: {exc}"
    return None
