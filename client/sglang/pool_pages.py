"""An SGLang HiCache host pool as kvstore pages (``PoolPages``): the namespace its
pages belong to, and each page as a span over the pool's own memory, so that gets land
in the pool and puts send from it with no copy of ours between.

A page is what the pool's ``get_page_buffer_meta`` names for it (SGLang's zero-copy
contract: the K and V buffers of a page, or one per layer and K/V, or one latent
buffer for MLA), those buffers back to back. Their order depends on the pool's layout,
so each layout is a page layout of its own (``kvstore.pages.layouts``, ``sglang_*``);
pages of two layouts never match. Reads SGLang's pool and config by their attributes
and imports nothing of SGLang."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from client.memory.buffers import Span, host_bytes, scattered_span
from client.sglang.options import HiCacheOptions
from kvstore.errors import InvalidInputError
from kvstore.pages.namespace import Namespace

# SGLang's host layouts, per kind of pool, and the page layout of each (the byte order of
# the buffers get_page_buffer_meta names for a page, back to back).
MHA_LAYOUTS = {
    "page_first": "sglang_2blhd",
    "page_first_direct": "sglang_2lbhd",
    "layer_first": "sglang_l2bhd",
    "page_head": "sglang_2hbld",
}
MLA_LAYOUTS = {
    "page_first": "sglang_mla_blhd",
    "page_first_direct": "sglang_mla_lbhd",
    "layer_first": "sglang_mla_lbhd",
}


def _refuse(what: str) -> InvalidInputError:
    return InvalidInputError(f"the kvstore HiCache backend does not serve {what}")


def pool_namespace(pool: Any, config: Any, options: HiCacheOptions) -> Namespace:
    """The namespace of ``pool``'s pages (an SGLang ``HostKVCache``: MHA or MLA) for the
    rank ``config`` (SGLang's ``HiCacheStorageConfig``) describes: model, dtype,
    geometry, layout, TP and PP rank, tenant. Raises ``InvalidInputError`` naming what
    it does not serve: decode context parallelism, split heads, a layout or pool kind
    without a page layout here, K and V of different widths."""
    if getattr(config, "dcp_size", 1) > 1 or getattr(config, "attn_cp_size", 1) > 1:
        raise _refuse("context parallelism (dcp_size or attn_cp_size above 1)")
    if getattr(config, "should_split_heads", False):
        raise _refuse("split heads (should_split_heads: prefill and decode of other TP sizes)")
    model = options.model or config.model_name
    if not model:
        raise InvalidInputError(
            'no model name: SGLang gave none; set "model" in the kvstore extra config'
        )
    layout = getattr(pool, "layout", None)
    mla = bool(config.is_mla_model)
    table = MLA_LAYOUTS if mla else MHA_LAYOUTS
    if layout not in table:
        kind = "MLA" if mla else "MHA"
        raise _refuse(f"the {kind} host layout {layout!r}; it serves {sorted(table)}")
    if getattr(pool, "kv_buffer", None) is None:
        raise _refuse(f"a host pool without one KV buffer ({type(pool).__name__})")
    dtype = str(pool.dtype).removeprefix("torch.")
    if dtype == "uint8":  # fp8 KV as SGLang stores it: bytes of either format
        if options.kv_cache_dtype is None:
            raise InvalidInputError(
                'an fp8 KV cache (a host pool of uint8) needs "kv_cache_dtype" in the kvstore '
                "extra config: float8_e4m3fn or float8_e5m2, as SGLang's --kv-cache-dtype"
            )
        dtype = options.kv_cache_dtype
    common = {
        "model": model,
        "dtype": dtype,
        "num_layers": pool.layer_num,
        "block_size": pool.page_size,
        "layout": table[layout],
        "tp_rank": config.tp_rank,
        "tp_size": config.tp_size,
        "pp_rank": config.pp_rank,
        "tenant": options.tenant,
    }
    if mla:
        # one latent row per token, the same on every TP rank: rank 0 writes, all read
        return Namespace(num_kv_heads=1, head_size=pool.kv_cache_dim, total_kv_heads=1, **common)
    v_width = getattr(pool, "v_head_dim", pool.head_dim)
    if v_width != pool.head_dim:
        raise _refuse(f"K and V of different widths ({pool.head_dim} and {v_width})")
    return Namespace(num_kv_heads=pool.head_num, head_size=pool.head_dim, **common)


@dataclass
class PoolPages:
    """One host pool's pages as spans (``spans``), for one namespace (``namespace``).
    Built once, when SGLang registers the pool with the backend."""

    pool: Any
    namespace: Namespace
    flat: np.ndarray  # the pool's KV buffer as bytes
    base: int  # its address

    @classmethod
    def of(cls, pool: Any, config: Any, options: HiCacheOptions) -> PoolPages:
        """``pool``'s pages; raises ``InvalidInputError`` (``pool_namespace``), or when a
        page of the pool is not the namespace's page size."""
        ns = pool_namespace(pool, config, options)
        buffer: torch.Tensor = pool.kv_buffer
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise _refuse(f"a KV buffer in {buffer.device} memory or not contiguous")
        pages = cls(pool, ns, host_bytes(buffer), buffer.data_ptr())
        first = torch.arange(pool.page_size, dtype=torch.int64)
        size = sum(span.nbytes for span in pages.spans(first))
        if size != ns.page_nbytes:
            raise InvalidInputError(
                f"a page of this {pool.layout} pool holds {size} bytes; its namespace's page "
                f"({ns.page_shape} of {ns.dtype}) holds {ns.page_nbytes}"
            )
        return pages

    def spans(self, host_indices: torch.Tensor) -> list[Span]:
        """A span per page of ``host_indices`` (token slots of the pool, a page's worth
        per page, as SGLang hands them to a v1 call), over the pool's memory."""
        page = self.pool.page_size
        if len(host_indices) % page:
            raise InvalidInputError(
                f"{len(host_indices)} host slots are not whole pages of {page} tokens"
            )
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        count = len(host_indices) // page
        if not count:
            return []
        per = len(ptrs) // count
        flat, base, end = self.flat, self.base, self.flat.nbytes
        out: list[Span] = []
        for i in range(0, len(ptrs), per):
            pieces = []
            for ptr, size in zip(ptrs[i : i + per], sizes[i : i + per], strict=True):
                at = ptr - base
                if at < 0 or at + size > end:
                    raise InvalidInputError(f"a page buffer at {ptr:#x} lies outside the pool")
                pieces.append((at, size))
            if per == 1:
                out.append(Span(flat, *pieces[0]))
            else:
                out.append(scattered_span(tuple(flat[at : at + size] for at, size in pieces)))
        return out
