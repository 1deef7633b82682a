"""Page codecs: per-token KV tensors <-> block pages, and the sequence tail object.

Block pages use the ``kv_lbhd`` layout ``[2, layers, block_size, kv_heads, head_size]``.
The tail of a sequence (its trailing partial block and, optionally, the hidden states
of every token) is one byte string cut into parts of at most ``TAIL_PART_BYTES``:

    header (32 bytes, little-endian): magic "KVST", u16 version, u16 flags (bit 0: hidden
    present), u32 token count, u32 partial-block tokens, u32 hidden size, 12 bytes zero
    partial KV  [2, layers, partial, kv_heads, head_size]
    hidden      [tokens, hidden_size]                    (only when flag bit 0 is set)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from client.memory.buffers import Span, scattered_span
from kvstore.errors import InvalidInputError
from kvstore.pages.namespace import Namespace

TAIL_MAGIC = b"KVST"
TAIL_VERSION = 1
TAIL_HEADER = struct.Struct("<4sHHIII12x")
TAIL_PART_BYTES = 4 << 20
FLAG_HIDDEN = 1


def kv_spans(
    namespace: Namespace, key: torch.Tensor, value: torch.Tensor, blocks: int, count: int
) -> list[Span]:
    """The units of the first ``blocks`` full blocks of ``key``/``value`` (contiguous CPU
    ``[layers, tokens, heads, head_size]``, the rank's heads in ``count`` groups it holds
    whole) as spans over the tensors themselves, unit by unit (every block's unit 0,
    then every block's unit 1: ``heads.unit_hashes``'s order). Unit j of block b is the
    ``kv_lbhd`` page of group j's heads: its key rows, then its value rows. insert puts
    from these spans and select gets into them: no page buffer between the caller's
    tensors and the nodes (a page buffer cost a strided copy and the page faults of a
    fresh buffer each way: select of 270 MB ran at 0.3-1.4 GB/s against get_pages'
    2.4-3.2 here)."""
    B, g = namespace.block_size, key.shape[2] // count
    k8, v8 = key.view(torch.uint8).numpy(), value.view(torch.uint8).numpy()
    return [
        scattered_span(
            (
                k8[:, b * B : (b + 1) * B, j * g : (j + 1) * g],
                v8[:, b * B : (b + 1) * B, j * g : (j + 1) * g],
            )
        )
        for j in range(count)
        for b in range(blocks)
    ]


def pages_into_kv(pages: torch.Tensor, kv: torch.Tensor) -> None:
    """Copy ``[blocks, 2, L, B, H, D]`` pages into the leading tokens of ``kv``
    ``[2, L, tokens, H, D]`` (one strided copy)."""
    n, _, _, B, _, _ = pages.shape
    kv[:, :, : n * B].unflatten(2, (n, B)).copy_(pages.permute(1, 2, 0, 3, 4, 5))


def tail_nbytes(namespace: Namespace, num_tokens: int, with_hidden: bool) -> int:
    partial = num_tokens % namespace.block_size
    size = TAIL_HEADER.size + partial * namespace.token_kv_nbytes
    if with_hidden:
        size += num_tokens * namespace.hidden_size * namespace.element_size
    return size


def tail_part_sizes(namespace: Namespace, num_tokens: int, with_hidden: bool) -> list[int]:
    total = tail_nbytes(namespace, num_tokens, with_hidden)
    return [min(TAIL_PART_BYTES, total - start) for start in range(0, total, TAIL_PART_BYTES)]


def encode_tail(
    namespace: Namespace, key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor | None
) -> np.ndarray:
    """The tail object of a sequence of ``key.shape[1]`` tokens as one uint8 array."""
    T = key.shape[1]
    nfull = T - T % namespace.block_size
    header = TAIL_HEADER.pack(
        TAIL_MAGIC,
        TAIL_VERSION,
        FLAG_HIDDEN if hidden is not None else 0,
        T,
        T - nfull,
        namespace.hidden_size,
    )
    parts = [np.frombuffer(header, dtype=np.uint8)]
    partial_kv = torch.stack([key[:, nfull:], value[:, nfull:]]).to("cpu").contiguous()
    parts.append(_bytes_of(partial_kv))
    if hidden is not None:
        parts.append(_bytes_of(hidden.to("cpu").contiguous()))
    return np.concatenate(parts)


@dataclass(frozen=True, slots=True)
class Tail:
    num_tokens: int
    partial_key: torch.Tensor
    partial_value: torch.Tensor
    hidden: torch.Tensor | None


def read_tail_flags(first_part: np.ndarray) -> tuple[int, bool] | None:
    """(token count, hidden present) from the header, or None if it is not a tail header."""
    if first_part.nbytes < TAIL_HEADER.size:
        return None
    magic, version, flags, tokens, _, _ = TAIL_HEADER.unpack(
        first_part[: TAIL_HEADER.size].tobytes()
    )
    if magic != TAIL_MAGIC or version != TAIL_VERSION:
        return None
    return tokens, bool(flags & FLAG_HIDDEN)


def decode_tail(namespace: Namespace, blob: np.ndarray) -> Tail:
    """Parse a tail object made by ``encode_tail`` with the same namespace."""
    _, _, flags, T, partial, hidden_size = TAIL_HEADER.unpack(blob[: TAIL_HEADER.size].tobytes())
    L, H, D = namespace.num_layers, namespace.num_kv_heads, namespace.head_size
    dtype = namespace.torch_dtype()
    pos = TAIL_HEADER.size
    kv_bytes = partial * namespace.token_kv_nbytes
    kv = _tensor_of(blob[pos : pos + kv_bytes], dtype, (2, L, partial, H, D))
    pos += kv_bytes
    hidden = None
    if flags & FLAG_HIDDEN:
        hbytes = T * hidden_size * namespace.element_size
        hidden = _tensor_of(blob[pos : pos + hbytes], dtype, (T, hidden_size))
    return Tail(T, kv[0], kv[1], hidden)


def _tensor_of(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor viewing ``raw`` (no copy: select lends the tail's buffer from the pool, and
    the view keeps it alive until the caller drops the hidden states)."""
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def check_kv(namespace: Namespace, name: str, t: torch.Tensor, num_tokens: int) -> None:
    """Raise ``InvalidInputError`` unless ``t`` is ``[layers, num_tokens, heads, head_size]``
    of the namespace dtype."""
    want = (namespace.num_layers, num_tokens, namespace.num_kv_heads, namespace.head_size)
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != want:
        raise InvalidInputError(
            f"{name} has shape {tuple(t.shape)}; the namespace expects {want} [layers, tokens, kv_heads, head_size]"
        )
    if t.dtype != namespace.torch_dtype():
        raise InvalidInputError(
            f"{name} has dtype {t.dtype}; the namespace expects {namespace.torch_dtype()}"
        )


def check_pages(
    namespace: Namespace, name: str, t: torch.Tensor, count: int, at_least: bool
) -> None:
    """Raise ``InvalidInputError`` unless ``t`` holds pages of the namespace
    (``[n, *page_shape]`` of its dtype): exactly ``count`` of them (a put), or at least
    ``count`` in contiguous memory (a get receives in place)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape[1:]) != namespace.page_shape:
        raise InvalidInputError(
            f"{name} pages have shape {tuple(t.shape[1:])}; "
            f"the namespace expects {namespace.page_shape} ({namespace.layout})"
        )
    if t.dtype != namespace.torch_dtype():
        raise InvalidInputError(
            f"{name} has dtype {t.dtype}; the namespace expects {namespace.torch_dtype()}"
        )
    if (t.shape[0] < count) if at_least else (t.shape[0] != count):
        rel = "at least" if at_least else "exactly"
        raise InvalidInputError(
            f"{name} has {t.shape[0]} pages; {count} full blocks of tokens need {rel} {count}"
        )
    if at_least and not t.is_contiguous():
        raise InvalidInputError(f"{name} must be contiguous so pages can be received in place")
