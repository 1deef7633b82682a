"""Chained block hashes, whole-sequence hashes and tail-part hashes.

The exact byte format is written down in docs/key-format.md and pinned by golden
vectors in tests/kvstore/pages/test_hashing.py. Nothing here depends on PYTHONHASHSEED."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.errors import InvalidInputError
from kvstore.pages._chainhash import chain, each, split_hashes, uint32_le
from kvstore.pages.identity import NO_EXTRAS, BlockExtras
from kvstore.pages.namespace import Namespace

HASH_BYTES = 16
ZERO_HASH = bytes(HASH_BYTES)
BLOCK_PERSON = b"kvs-block-v1"
# A block whose hash a request identity changes (kvstore.pages.identity): its own
# person, and the identity's 16-byte digest after the tokens.
EXTRA_BLOCK_PERSON = b"kvs-blockx-v1"
SEQUENCE_PERSON = b"kvs-seq-v1"
EXTRA_SEQUENCE_PERSON = b"kvs-seqx-v1"
PART_PERSON = b"kvs-part-v1"
PREFIX_PERSON = b"kvs-prefix-v1"
MAX_TOKEN_ID = 2**32 - 1
TOKEN_RANGE = f"token ids must lie in [0, {MAX_TOKEN_ID}]"


def _from_plain_ints(
    convert: Callable[[list | tuple], bytes], tokens: list | tuple
) -> bytes | None:
    """``convert(tokens)`` (a C pass over a list or tuple of plain ints); None when an
    item is not a plain int, for numpy to convert or name the problem."""
    try:
        return convert(tokens)
    except OverflowError:
        raise InvalidInputError(TOKEN_RANGE) from None
    except TypeError:
        return None


def token_array(tokens: Any) -> np.ndarray:
    """Validate token ids and return them as a little-endian uint32 array.

    Accepts a list/tuple of ints, a numpy array or a CPU/GPU torch tensor (1-D)."""
    if isinstance(tokens, (list, tuple)):
        # Engines hand prompts over as lists. Converting and range-checking 131,072 ids
        # (8,192 blocks) measured here: numpy 6.5 ms, array.array 1.4 ms, this C loop 0.28.
        raw = _from_plain_ints(uint32_le, tokens)
        if raw is not None:
            return np.frombuffer(raw, dtype="<u4")
    if hasattr(tokens, "detach"):  # torch tensor, without importing torch here
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidInputError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise InvalidInputError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID:
        raise InvalidInputError(TOKEN_RANGE)
    return arr.astype("<u4", copy=False)


def block_hashes(namespace: Namespace, tokens: Any, extras: BlockExtras = NO_EXTRAS) -> list[bytes]:
    """Hashes of every full block of ``tokens``; a trailing partial block is ignored.

    hash[i] = blake2b-128(person="kvs-block-v1", ns_digest || hash[i-1] || tokens of block i
    as uint32 little-endian), with hash[-1] = 16 zero bytes. A block that ``extras`` names
    (a request identity: kvstore.pages.identity) hashes with person "kvs-blockx-v1" and its
    16-byte digest appended. Two token lists sharing k full blocks and the extras of
    those blocks share exactly their first k hashes."""
    return split_hashes(block_hash_bytes(namespace, tokens, extras))


def block_hash_bytes(namespace: Namespace, tokens: Any, extras: BlockExtras = NO_EXTRAS) -> bytes:
    """``block_hashes`` joined into one bytes object (16 bytes per full block, in order),
    without an object per block: what the index's lookup takes. The client's lookups
    (``find``) hash with it; a list costs 0.35 ms more at 8,192 blocks (measured here)."""
    # kvstore/pages/_chainhash.c runs the loop (8,192 blocks from a token list: 4x faster than
    # the same loop over hashlib, bench/lookup.py); tests/kvstore/pages/test_hashing.py holds it to
    # hashlib. A list goes in as it is: converted a block at a time, no 512 KiB buffer.
    size = 4 * namespace.block_size

    def hashed(data: Any, start: bytes = ZERO_HASH) -> bytes:
        return chain(namespace.digest, data, size, BLOCK_PERSON, start)

    if extras:
        return _with_extras(namespace, token_array(tokens), extras, hashed)
    if isinstance(tokens, (list, tuple)):
        joined = _from_plain_ints(hashed, tokens)
        if joined is not None:
            return joined
    return hashed(token_array(tokens))


def _with_extras(
    namespace: Namespace, arr: np.ndarray, extras: BlockExtras, hashed: Callable[..., bytes]
) -> bytes:
    """The chain of ``arr``'s full blocks where ``extras`` names some: each named block
    in Python, the plain runs between them in the C loop, started from the hash before."""
    bs = namespace.block_size
    full = len(arr) // bs
    out, prev, at = [], ZERO_HASH, 0
    for block, digest in extras.upto(full):
        if block > at:
            out.append(hashed(arr[at * bs : block * bs], prev))
            prev = out[-1][-HASH_BYTES:]
        prev = extra_block_hash(namespace, prev, arr[block * bs : (block + 1) * bs], digest)
        out.append(prev)
        at = block + 1
    if at < full:
        out.append(hashed(arr[at * bs : full * bs], prev))
    return b"".join(out)


def extra_block_hash(
    namespace: Namespace, prev: bytes, block_tokens: np.ndarray, digest: bytes
) -> bytes:
    """The hash of one block that a request identity changes (docs/key-format.md)."""
    return hashlib.blake2b(
        namespace.digest + prev + block_tokens.astype("<u4", copy=False).tobytes() + digest,
        digest_size=HASH_BYTES,
        person=EXTRA_BLOCK_PERSON,
    ).digest()


def reference_block_hashes(
    namespace: Namespace, tokens: Any, extras: BlockExtras = NO_EXTRAS
) -> list[bytes]:
    """``block_hashes`` spelled out with hashlib, one block at a time: the construction in
    docs/key-format.md as plain Python. tests/kvstore/pages/test_hashing.py holds the C loop to it and
    bench/lookup.py times the two side by side; nothing else should call it (it is 5-7x
    slower)."""
    arr = token_array(tokens)
    bs, prev, out = namespace.block_size, ZERO_HASH, []
    for i in range(len(arr) // bs):
        block = arr[i * bs : (i + 1) * bs]
        digest = extras.at(i)
        if digest is None:
            prev = hashlib.blake2b(
                namespace.digest + prev + block.tobytes(),
                digest_size=HASH_BYTES,
                person=BLOCK_PERSON,
            ).digest()
        else:
            prev = extra_block_hash(namespace, prev, block, digest)
        out.append(prev)
    return out


def sequence_hash(
    namespace: Namespace,
    tokens: Any,
    full_block_hashes: list[bytes] | None = None,
    extras: BlockExtras = NO_EXTRAS,
) -> bytes:
    """Hash of the whole token list, trailing partial block included.

    blake2b-128(person="kvs-seq-v1", ns_digest || last full block hash (or zeros) ||
    uint64-le token count || partial-block tokens as uint32 little-endian). When
    ``extras`` names the partial block, person "kvs-seqx-v1" and its digest appended."""
    arr = token_array(tokens)
    hashes = (
        full_block_hashes if full_block_hashes is not None else block_hashes(namespace, arr, extras)
    )
    nfull = len(hashes) * namespace.block_size
    tail_digest = extras.at(len(hashes)) if nfull < len(arr) else None
    h = hashlib.blake2b(
        digest_size=HASH_BYTES,
        person=SEQUENCE_PERSON if tail_digest is None else EXTRA_SEQUENCE_PERSON,
    )
    h.update(namespace.digest)
    h.update(hashes[-1] if hashes else ZERO_HASH)
    h.update(struct.pack("<Q", len(arr)))
    h.update(arr[nfull:].tobytes())
    if tail_digest is not None:
        h.update(tail_digest)
    return h.digest()


def part_hashes(seq_hash: bytes, count: int) -> list[bytes]:
    """Keys of the parts of a sequence's tail object: blake2b-128(person="kvs-part-v1",
    seq_hash || uint32-le part index)."""
    if len(seq_hash) != HASH_BYTES:
        raise InvalidInputError(f"sequence hash must be {HASH_BYTES} bytes, got {len(seq_hash)}")
    return [
        hashlib.blake2b(
            seq_hash + struct.pack("<I", i), digest_size=HASH_BYTES, person=PART_PERSON
        ).digest()
        for i in range(count)
    ]


KEY_PERSON = b"kvs-key-v1"


def _utf8(key: str) -> bool:
    try:
        key.encode()
    except UnicodeEncodeError:
        return False
    return True


def keyed_hash_bytes(namespace: Namespace, page_keys: list[str]) -> bytes:
    """The storage hashes of an engine's own page keys (a keyed layout's pages:
    SGLang's HiCache keys, each chained over its prefix by the engine), joined, 16 bytes
    per key in order: blake2b-128(person="kvs-key-v1", ns_digest || key as UTF-8). The
    digest makes a key name different pages in different namespaces (models, ranks,
    tenants), as it does for token chains. Callers: ``PrefixLookup.keyed_hashes``."""
    if not namespace.keyed:
        raise InvalidInputError(
            f"layout {namespace.layout!r} keys pages by token ids; page keys need a keyed layout"
        )
    try:
        return each(namespace.digest, page_keys, KEY_PERSON)
    except (ValueError, TypeError):  # the C loop names no key in words: find it
        if not isinstance(page_keys, (list, tuple)):
            raise InvalidInputError("page keys must come as a list or tuple of str") from None
        bad = next((k for k in page_keys if not isinstance(k, str) or not k or not _utf8(k)), None)
        raise InvalidInputError(
            f"a page key must be a non-empty string that UTF-8 can hold, got {bad!r:.80}"
        ) from None


def prefix_fingerprint(block_size: int, tokens: Any, extras: BlockExtras = NO_EXTRAS) -> bytes:
    """What names a prefix across engines without a namespace: blake2b-128(person
    "kvs-prefix-v1", uint32-le block size || the tokens as uint32-le || for each block
    ``extras`` names below the prefix's full blocks, uint32-le block index || its digest).

    A prefill engine announces the prefix it is saving with it (a P/D handoff's
    ``kv_transfer_params``); the decode engine computes it from its own prompt and
    identity, and waits for the announced pages only when both agree. Engines whose
    pages the store keeps apart (another model, dtype or geometry) may agree here: their
    wait then ends at its deadline, never in foreign KV, since the pages are found under
    the decode's own namespace."""
    arr = token_array(tokens)
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=PREFIX_PERSON)
    h.update(struct.pack("<I", block_size))
    h.update(arr.tobytes())
    for block, digest in extras.upto(len(arr) // block_size):
        h.update(struct.pack("<I", block))
        h.update(digest)
    return h.digest()
