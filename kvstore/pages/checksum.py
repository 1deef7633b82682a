"""Page checksums: 64-bit xxh3 over the page bytes (about 30 GB/s here, releases the GIL).

Computed by the client before a put, verified by the server before it commits a page
and by the client after every receive."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import numpy as np
import xxhash

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

# One helper thread. It hashes or copies and hashes half of what the calling thread
# has to (``checksums``, ``copy_checksummed``), or hashes a UCX put's pages while
# its plan is on its way (``HashAhead``). Below OFFLOAD_MIN the hand-off costs more
# than the hash (1,024 pages of 64 KiB: get 0.66 GB/s inline, 0.41 handed off).
_helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-xxh3")
OFFLOAD_MIN = 512 << 10

# Pages are copied and hashed a chunk at a time, the chunk hashed while it is still
# in this core's cache (1 MiB of L2 here). Measured on this 2-core VM, 32 pages of
# 2 MiB out of a memfd mapping, GB/s of the copy: copy alone 9.4; copy, then hash
# the page on the helper thread while the next page copies 5.3; both threads each
# copying and hashing their half, chunk by chunk, 6.3 (256 KiB chunks 6.3, 1 MiB 6.5,
# whole pages 5.8). Hashing the whole page after its copy reads it back from memory,
# and the two streams compete for the memory bandwidth that bounds the copy.
# ``CHUNK`` is the Python loop's; the C loop (below) works in 64 KiB.
CHUNK = 1 << 20

# The copy and its hash run in one C loop without the GIL (_copyhash.c) whenever every
# piece is C-contiguous; the Python loop (``_copy_one``) takes the rest (caches whose
# blocks are strided). Measured, the TTFT bench's 120 MiB load (96 pages, 10 pieces
# each, from a memfd mapping into layer tensors), 20 rounds interleaved in one
# process (bench/load_copy.py, bench/load_copy.txt): Python loop 21.6 ms, C loop with
# plain stores 13.8 ms, with non-temporal stores 11.3 ms (numpy's copy alone, no hash:
# 13.6). Streaming stores skip reading the
# destination in before writing it, but leave it out of the cache: a copy of at
# least STREAM_MIN bytes, whose destination is not hashed (it is not read back), uses
# them.
STREAM_MIN = 8 << 20


def page_checksum(buffer: Buffer | np.ndarray) -> int:
    """xxh3-64 of any object exposing the buffer protocol (numpy arrays, memoryviews)."""
    # numpy's stubs give ndarray __buffer__ only from Python 3.12; it has the protocol at run time
    return xxhash.xxh3_64_intdigest(buffer)  # type: ignore[arg-type]


def _bind_copy_loop() -> ModuleType | None:
    """The C loop, or None when it cannot give xxhash's own digests: it calls the
    XXH3 functions of the xxhash extension Python loaded, found by name; a build of
    xxhash that does not export them, or one whose digests differ, keeps the Python
    loop (logged)."""
    try:
        from kvstore.pages import _copyhash

        # private: xxhash exports no C API, and dlopen needs the path of its loaded extension
        path = importlib.import_module("xxhash._xxhash").__file__
        if path is None:
            raise ImportError("the xxhash extension was not loaded from a file")
        if not _copyhash.bind(path):
            raise ImportError("the xxhash extension exports no XXH3 functions")
        rng = np.random.default_rng(7)
        for size in (0, 1, 16, 17, 129, 240, 241, 1023, 65537, 300_001):
            src = rng.integers(0, 256, size, dtype=np.uint8)
            cut = (size // 3, size // 3 + size // 5)
            pieces = (
                np.empty(cut[0], np.uint8),
                np.empty(cut[1] - cut[0], np.uint8),
                np.empty(size - cut[1], np.uint8),
            )
            flat = np.empty(size, np.uint8)
            if _copyhash.copy_hash([(pieces, src), (flat, pieces)], False, False) != [
                page_checksum(src)
            ] * 2 or not np.array_equal(flat, src):
                raise ImportError(f"its digests differ from xxhash's ({size} bytes)")
        return _copyhash
    except (ImportError, OSError) as exc:
        log.warning("page copies and their checksums take the slower Python loop: %s", exc)
        return None


_copy_loop = _bind_copy_loop()


def start_helper() -> None:
    """Start the helper thread now (client start), not inside the first transfer."""
    _helper.submit(int).result()


# A page whose bytes are scattered: uint8 arrays whose C orders, one after another, are
# the page's bytes.
Pieces: TypeAlias = tuple[np.ndarray, ...]


def _pieces_chunks(pieces: Pieces) -> list[np.ndarray]:
    """The pieces cut along their first axes into chunks of at most CHUNK bytes (a row
    larger than CHUNK stays whole), in page order."""
    chunks = []
    for piece in pieces:
        if piece.nbytes <= CHUNK or piece.ndim < 2:
            chunks.append(piece)
            continue
        step = max(1, CHUNK // (piece.nbytes // piece.shape[0]))
        chunks.extend(piece[at : at + step] for at in range(0, piece.shape[0], step))
    return chunks


def _copy_one(dst: np.ndarray | Pieces, src: np.ndarray | Pieces, hash_source: bool) -> int:
    """Copy one page and hash it chunk by chunk while the chunk is in cache. When one side
    is scattered (``Pieces``), the contiguous side is hashed whatever ``hash_source``
    says: for a get that is the node's pinned, read-only slot the bytes came from; for
    a put the slot the node verifies."""
    if isinstance(dst, tuple):
        # one side of a pair at most is scattered (copy_checksummed)
        assert not isinstance(src, tuple)
        return _copy_scattered(src, dst, into_pieces=True)
    if isinstance(src, tuple):
        return _copy_scattered(dst, src, into_pieces=False)
    if dst.nbytes <= CHUNK:
        dst[:] = src
        return page_checksum(src if hash_source else dst)
    digest = xxhash.xxh3_64()  # streamed: the same value as the one-shot hash
    for at in range(0, dst.nbytes, CHUNK):
        d, s = dst[at : at + CHUNK], src[at : at + CHUNK]
        d[:] = s
        digest.update(s if hash_source else d)  # type: ignore[arg-type]  # ndarray: see page_checksum
    return digest.intdigest()


def _copy_scattered(flat: np.ndarray, pieces: Pieces, into_pieces: bool) -> int:
    """``_copy_one`` where one side is scattered: copy between ``flat`` and ``pieces``
    (into the pieces when ``into_pieces``), hashing ``flat`` chunk by chunk."""
    digest = xxhash.xxh3_64()  # streamed: the same value as the one-shot hash
    pos = 0
    for chunk in _pieces_chunks(pieces):
        part = flat[pos : pos + chunk.nbytes]
        if into_pieces:
            chunk[...] = part.reshape(chunk.shape)
        else:
            part.reshape(chunk.shape)[...] = chunk
        digest.update(part)  # type: ignore[arg-type]  # ndarray: see page_checksum
        pos += chunk.nbytes
    return digest.intdigest()


def _copy_run(
    pairs: Sequence[tuple[np.ndarray | Pieces, np.ndarray | Pieces]],
    hash_source: bool,
    stream: bool,
) -> list[int]:
    """One thread's share of ``copy_checksummed``: in C when every piece is
    C-contiguous, else in the Python loop."""
    if _copy_loop is not None:
        digests = _copy_loop.copy_hash(pairs, hash_source, stream)
        if digests is not None:
            return digests
    return [_copy_one(dst, src, hash_source) for dst, src in pairs]


def _nbytes(side: np.ndarray | Pieces) -> int:
    return sum(p.nbytes for p in side) if isinstance(side, tuple) else side.nbytes


def _split(sizes: list[int]) -> int:
    """Where a list of sizes divides into two parts of about half the bytes each (the
    first part at least one item)."""
    total, half, split = sum(sizes), 0, 0
    while split < len(sizes) - 1 and half + sizes[split] <= total // 2:
        half += sizes[split]
        split += 1
    return max(split, 1)


_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


def _on_both(
    items: Sequence[_Item],
    sizes: list[int],
    work: Callable[[Sequence[_Item]], list[_Result]],
) -> list[_Result]:
    """``work(items)`` with the calling thread and the helper thread each taking about
    half the bytes (``work`` maps a list to a list of results, in order); returns only
    once both halves are done. Small or single items stay on the calling thread."""
    if len(items) < 2 or sum(sizes) < 2 * OFFLOAD_MIN:
        return work(items)
    split = _split(sizes)
    later = _helper.submit(work, items[split:])
    try:
        first = work(items[:split])
    finally:
        rest = later.result()
    return first + rest


def _hash_all(buffers: Sequence) -> list[int]:
    return [page_checksum(b) for b in buffers]


def checksums(buffers: Sequence) -> list[int]:
    """``page_checksum`` of each buffer, in order, the calling thread and the helper
    thread each hashing about half the bytes. Called where pages are hashed with
    nothing else to do meanwhile: a UCX put's pages before they leave, the pages of a
    run that landed, a node verifying a put. Measured, 32 pages of 2 MiB (20 rounds):
    1.97 ms (1.78-2.13) on one thread, 1.72 ms (1.54-2.39) on two: memory bandwidth,
    not the hash, bounds it here, so the second thread gains little on this VM."""
    return _on_both(buffers, [memoryview(b).nbytes for b in buffers], _hash_all)


class HashAhead:
    """Hash pages in order on the helper thread, each result handed to ``record(k,
    digest)``, until ``stop``. A UCX put starts it when its request leaves, so the
    pages the node will most likely ask for are hashed while the plan is on its way
    (about 2 ms here); ``stop`` bounds the waste when the node holds them already to
    what was hashed meanwhile."""

    def __init__(self, buffers: Sequence[Any], record: Callable[[int, int], object]) -> None:
        self._stopped = False
        self._future = _helper.submit(self._run, list(buffers), record)

    def _run(self, buffers: list[Any], record: Callable[[int, int], object]) -> None:
        for k, buf in enumerate(buffers):
            if self._stopped:
                return
            record(k, page_checksum(buf))

    def stop(self) -> None:
        """Stop after the page being hashed now; returns once the helper has."""
        self._stopped = True
        self._future.result()


def copy_checksummed(
    pairs: Sequence[tuple[np.ndarray | Pieces, np.ndarray | Pieces]], hash_source: bool = False
) -> list[int]:
    """Copy each ``(dst, src)`` pair of equal-sized uint8 arrays and return, in order,
    the xxh3-64 of the bytes that landed in ``dst`` (what a reader verifies) or, with
    ``hash_source``, of ``src`` (what a writer vouches for: bytes someone else changes
    in ``dst`` meanwhile then fail verification). One side of a pair may be scattered
    (``Pieces``: the caller's tensors in insert/select, a paged cache's blocks), and
    then the contiguous side is hashed (``_copy_one``). Called by the same-host data
    path (client/nodes/connection.py) for gets and puts, and to pack UCX runs. The calling
    thread and the helper thread each take half the bytes, in C without the GIL where
    every piece is C-contiguous (``_copy_run``); returns only once both are done, so
    nothing writes into any ``dst`` after it returns, whatever the caller's timeout."""
    sizes = [_nbytes(dst) for dst, _ in pairs]
    stream = sum(sizes) >= STREAM_MIN
    return _on_both(pairs, sizes, lambda part: _copy_run(part, hash_source, stream))
