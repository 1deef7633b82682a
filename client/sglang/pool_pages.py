"""An SGLang HiCache host pool as kvstore pages (``PoolPages``): the namespace its
pages belong to, and each page as a span over the pool's own memory, so that gets land
in the pool and puts send from it with no copy of ours between.

A page is what the pool's ``get_page_buffer_meta`` names for it (SGLang's zero-copy
contract: the K and V buffers of a page, or one per layer and K/V, or one latent
buffer for MLA), those buffers back to back. Their order depends on the pool's layout,
so each layout is a page layout of its own (``kvstore.pages.layouts``, ``sglang_*``);
pages of two layouts never match. A hybrid model's side pools (Mamba states,
sliding-window KV: ``side_namespace``) are pages of their own namespaces, their bytes
as uint8 (layout ``sglang_pool_bytes``), the pool and its format named in the
namespace's ``state``. Reads SGLang's pools and config by their attributes and imports
nothing of SGLang."""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from client.memory.buffers import Span, host_bytes, scattered_span
from client.sglang.options import HiCacheOptions
from kvstore.errors import InvalidInputError
from kvstore.pages.layouts import LAYOUTS
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


# A side pool's attributes that make its page bytes mean one thing (a Mamba pool's state
# dtypes and shapes, a KV-like pool's geometry), named in its namespace's ``state``.
_FORMAT_FIELDS = (
    "dtype", "layer_num", "head_num", "head_dim", "v_head_dim", "kv_cache_dim",
    "num_mamba_layers", "conv_dtype", "temporal_dtype", "conv_state_shapes",
    "temporal_state_shape",
)  # fmt: skip


def side_namespace(pool: Any, name: str, kv: Namespace, page_nbytes: int) -> Namespace:
    """The namespace of a hybrid model's side pool ``name`` (``pool``, registered
    beside the KV pool whose namespace is ``kv``): the KV namespace's model, ranks,
    tenant and weights, a page of ``page_nbytes`` bytes (uint8, layout
    ``sglang_pool_bytes``) per ``pool.page_size`` tokens, and the pool's name, class,
    layout and format in ``state``, with the KV's dtype (an fp8 pool's bytes are e4m3
    or e5m2 as the KV's are). Ranks share its pages as SGLang backs them up: beside
    MLA's replicated latent, one copy written by rank 0 (SGLang's storage writer), but
    a Mamba state, which TP splits, a share per rank, every rank writing its own;
    beside MHA KV, a share per rank."""
    parts = [f"sglang {name}", type(pool).__name__, f"layout {getattr(pool, 'layout', None)}"]
    parts += [f"{f} {getattr(pool, f)}" for f in _FORMAT_FIELDS if hasattr(pool, f)]
    parts.append(f"kv {kv.dtype}")
    replicated = LAYOUTS[kv.layout].latent and name != "mamba"
    state = "; ".join(parts)
    if len(state) > 200:  # the field holds 512: a long format by its digest
        state = f"sglang {name}; {hashlib.blake2b(state.encode(), digest_size=16).hexdigest()}"
    return Namespace.model_validate(
        {
            **kv.model_dump(),
            "dtype": "uint8",
            "layout": "sglang_pool_bytes",
            "num_layers": 1,
            "num_kv_heads": 1,
            "head_size": page_nbytes,
            "block_size": pool.page_size,
            "total_kv_heads": 1 if replicated else kv.tp_size,
            "head_groups": 0,
            "total_layers": 0,
            "first_layer": 0,
            "layer_groups": 0,
            "state": state,
        }
    )


def _host_buffers(pool: Any) -> list[tuple[int, np.ndarray]]:
    """The host memory a pool's pages lie in, by address, as bytes: the storage under
    each CPU tensor the pool holds (as an attribute, or in a list or tuple of them) that
    holds a piece of its first page as its ``get_page_buffer_meta`` names it (a KV
    pool's one KV buffer; a Mamba pool's temporal and conv buffers). Only those: the
    pool's other tensors (its free-slot lists) are replaced as it runs, and a view kept
    here would keep the old ones' memory."""
    storages: dict[int, Any] = {}
    for value in vars(pool).values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor) and item.device.type == "cpu" and item.numel():
                storage = item.untyped_storage()
                storages.setdefault(storage.data_ptr(), storage)
    ptrs, _ = pool.get_page_buffer_meta(torch.arange(pool.page_size, dtype=torch.int64))
    out = []
    for address, storage in sorted(storages.items()):
        if any(address <= ptr < address + storage.nbytes() for ptr in ptrs):
            whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            out.append((address, host_bytes(whole)))
    return out


@dataclass
class PoolPages:
    """One host pool's pages as spans (``spans``), for one namespace (``namespace``).
    Built once, when SGLang registers the pool with the backend."""

    pool: Any
    namespace: Namespace
    buffers: list[tuple[int, np.ndarray]]  # the pool's host memory, by address

    @classmethod
    def of(cls, pool: Any, config: Any, options: HiCacheOptions) -> PoolPages:
        """``pool``'s pages (SGLang's KV host pool); raises ``InvalidInputError``
        (``pool_namespace``), or when a page of the pool is not the namespace's page
        size."""
        ns = pool_namespace(pool, config, options)
        buffer: torch.Tensor = pool.kv_buffer
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise _refuse(f"a KV buffer in {buffer.device} memory or not contiguous")
        pages = cls(pool, ns, _host_buffers(pool))
        size = pages.page_nbytes()
        if size != ns.page_nbytes:
            raise InvalidInputError(
                f"a page of this {pool.layout} pool holds {size} bytes; its namespace's page "
                f"({ns.page_shape} of {ns.dtype}) holds {ns.page_nbytes}"
            )
        return pages

    @classmethod
    def side(cls, pool: Any, name: str, kv: Namespace) -> PoolPages:
        """A hybrid model's side pool ``name`` (``side_namespace``); raises
        ``InvalidInputError`` for a pool whose pages cannot be named as spans over its
        host memory (SGLang's ``get_page_buffer_meta`` refuses: a Mamba pool whose
        slots carry side states)."""
        try:
            pages = cls(pool, kv, _host_buffers(pool))
            size = pages.page_nbytes()
        except (NotImplementedError, ValueError, AttributeError, AssertionError) as exc:
            raise _refuse(f"SGLang's {name} pool ({type(pool).__name__}): {exc}") from None
        pages.namespace = side_namespace(pool, name, kv, size)
        return pages

    def page_nbytes(self) -> int:
        """The bytes of the pool's first page, as its ``get_page_buffer_meta`` names them."""
        first = torch.arange(self.pool.page_size, dtype=torch.int64)
        return sum(span.nbytes for span in self.spans(first))

    def spans(self, host_indices: torch.Tensor) -> list[Span]:
        """A span per page of ``host_indices`` (slots of the pool, a page's worth per
        page, as SGLang hands them to a v1 or v2 call), over the pool's memory."""
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
        bases = [address for address, _ in self.buffers]
        out: list[Span] = []
        for i in range(0, len(ptrs), per):
            pieces = []
            for ptr, size in zip(ptrs[i : i + per], sizes[i : i + per], strict=True):
                k = bisect_right(bases, ptr) - 1
                flat = self.buffers[k][1] if k >= 0 else None
                at = ptr - bases[k] if k >= 0 else -1
                if flat is None or at + size > flat.nbytes:
                    raise InvalidInputError(f"a page buffer at {ptr:#x} lies outside the pool")
                pieces.append((flat, at, size))
            if per == 1:
                out.append(Span(*pieces[0]))
            else:
                out.append(scattered_span(tuple(f[at : at + size] for f, at, size in pieces)))
        return out
