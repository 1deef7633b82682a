"""Whether an engine's configuration can use the store: TensorRT-LLM's
``inquireSupport``, for vLLM.

``KVStoreConnector`` asks once, at start, on both sides. An engine the store cannot
serve gets one WARNING line naming what differs (from the scheduler side; workers log
it at DEBUG) and then makes no lookups and no saves: it runs as if the connector were
absent, instead of failing its start or, worse, loading pages it would read wrongly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.pages.namespace import DTYPE_SIZES

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# The kinds of vLLM KV-cache groups whose pages the connector moves: full attention
# (K and V per head) and MLA (one latent row per token).
SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def cache_dtype(vllm_config: VllmConfig) -> str:
    """The KV cache's element dtype (torch name)."""
    cache = vllm_config.cache_config
    name = CACHE_DTYPES.get(cache.cache_dtype, cache.cache_dtype) or vllm_config.model_config.dtype
    return str(name).removeprefix("torch.")


def unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str | None:
    """Why this engine cannot use the store, in a few words; None when it can."""
    dtype = cache_dtype(vllm_config)
    if dtype not in DTYPE_SIZES:
        return f"kv-cache dtype {vllm_config.cache_config.cache_dtype!r} ({dtype}) is not one kvstore stores ({', '.join(sorted(DTYPE_SIZES))})"
    parallel = vllm_config.parallel_config
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        return f"decode_context_parallel_size {parallel.decode_context_parallel_size}: blocks split across ranks by token are not stored"
    if kv_cache_config is not None:
        groups = kv_cache_config.kv_cache_groups
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        if len(groups) != 1:
            return f"{len(groups)} KV-cache groups ({', '.join(kinds)}): hybrid attention is not stored yet"
        if kinds[0] not in SUPPORTED_SPECS:
            return f"attention of kind {kinds[0]} (kvstore stores {' and '.join(SUPPORTED_SPECS)})"
        quant = getattr(groups[0].kv_cache_spec, "kv_quant_mode", None)
        if quant:  # quantized KV keeps scales beside the blocks, which pages would not carry
            return f"quantized KV cache ({getattr(quant, 'name', quant)}): its scales are not stored"
    return None
