"""Whether an engine's configuration can use the store: TensorRT-LLM's
``inquireSupport``, for vLLM.

``KVStoreConnector`` asks once, at start, on both sides. An engine the store cannot
serve gets one WARNING line naming what differs (from the scheduler side; workers log
it at DEBUG) and then makes no lookups and no saves: it runs as if the connector were
absent, instead of failing its start or, worse, loading pages it would read wrongly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.pages.heads import rank_units
from kvstore.pages.namespace import DTYPE_SIZES

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvstore.pages.namespace import Namespace

# The kinds of vLLM KV-cache groups whose pages the connector moves: full attention
# (K and V per head) and MLA (one latent row per token).
SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
# With vLLM's hybrid KV-cache manager: groups of full attention and sliding-window
# attention, stored together (a page is one block of every layer, as without it).
HYBRID_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")
CACHE_DTYPES = {
    "auto": None,
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def cache_dtype(vllm_config: VllmConfig) -> str:
    """The KV cache's element dtype (torch name)."""
    cache = vllm_config.cache_config
    name = CACHE_DTYPES.get(cache.cache_dtype, cache.cache_dtype) or vllm_config.model_config.dtype
    return str(name).removeprefix("torch.")


def draft_layers(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[str]:
    """The KV-cache layers of ``kv_cache_config`` that are not the target model's: a
    draft model's (``draft_model.model.layers.N``, the same index as a target layer) or an
    EAGLE/MTP head's (``model.layers.N`` past the target's last layer). Judged from the
    groups' layer names, which the scheduler's and the workers' configs share (vLLM gives
    the scheduler only the first layer's spec of a group whose layers differ,
    ``generate_scheduler_kv_cache_config``, so specs cannot tell), so both sides decide
    alike. ngram and suffix decoding add no layers and are not named here."""
    from vllm.model_executor.models.utils import extract_layer_index

    if vllm_config.speculative_config is None:  # no draft: every layer is the target's
        return []
    total = vllm_config.model_config.get_total_num_hidden_layers()
    names = [name for group in kv_cache_config.kv_cache_groups for name in group.layer_names]
    seen: set[int] = set()
    drafts = []
    # the target's layers first, so a draft layer sharing a target layer's index is the one named
    for name in sorted(names, key=lambda n: n.startswith("draft_model.")):
        try:
            index = extract_layer_index(name)
        except AssertionError:  # several indices in one name: no decoder layer of either model
            continue
        if index >= total or index in seen or name.startswith("draft_model."):
            drafts.append(name)
        seen.add(index)
    return drafts


def unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str | None:
    """Why this engine cannot use the store, in a few words; None when it can."""
    dtype = cache_dtype(vllm_config)
    if dtype not in DTYPE_SIZES:
        stored = ", ".join(sorted(DTYPE_SIZES))
        return f"kv-cache dtype {vllm_config.cache_config.cache_dtype!r} ({dtype}) is not one kvstore stores ({stored})"
    parallel = vllm_config.parallel_config
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        size = parallel.decode_context_parallel_size
        return f"decode_context_parallel_size {size}: blocks split across ranks by token are not stored"
    if kv_cache_config is not None:
        # A draft's layers are stored apart (client.vllm.drafts, which also says which
        # drafts cannot be); their group may hold layers of two shapes.
        drafted = bool(draft_layers(vllm_config, kv_cache_config))
        return _groups_refusal(vllm_config, kv_cache_config, drafted)
    return None


def _layer_kinds(group: KVCacheGroupSpec) -> list[str]:
    """The spec kinds of a group's layers: a group whose layers differ in shape (a
    draft with other heads than the target's) holds them in ``UniformTypeKVCacheSpecs``;
    vLLM gives the scheduler its first layer's spec instead, so both kinds are read."""
    inner = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    if inner:
        return sorted({type(spec).__name__ for spec in inner.values()})
    return [type(group.kv_cache_spec).__name__]


def _groups_refusal(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, drafted: bool = False
) -> str | None:
    """Why the KV-cache groups cannot be stored, or None. One group of full attention or
    MLA, as ever; or, with vLLM's hybrid KV-cache manager on, groups of full attention
    and sliding-window attention of one page shape (``hybrid_groups``): every block is
    still stored as one page over all layers."""
    every = kv_cache_config.kv_cache_groups
    # a state-space hybrid's state groups are stored apart (client.vllm.states, which
    # says which cannot be); its attention groups are checked here as any engine's
    groups = [g for g in every if type(g.kv_cache_spec).__name__ != "MambaSpec"]
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    listed = f"{len(groups)} KV-cache groups ({', '.join(kinds)})"
    if not groups:  # a state-space model without attention is refused by client.vllm.states
        return None if every else "no KV-cache groups"
    if len(groups) == 1:
        layer_kinds = _layer_kinds(groups[0]) if drafted else kinds
        other = [k for k in layer_kinds if k not in SUPPORTED_SPECS]
        if other:
            return f"attention of kind {other[0]} (kvstore stores {' and '.join(SUPPORTED_SPECS)})"
    else:
        other = [k for k in kinds if k not in HYBRID_SPECS]
        if other:
            stored = " and ".join(HYBRID_SPECS)
            return f"{listed}: {other[0]} layers are not stored beside other groups (kvstore stores {stored})"
        specs = [g.kv_cache_spec for g in groups]
        shapes = {
            (s.block_size, *(getattr(s, a, None) for a in ("num_kv_heads", "head_size", "dtype")))
            for s in specs
        }
        if len(shapes) != 1:  # one page holds a block of every layer: their blocks must be alike
            return f"{listed} of different block sizes, KV heads, head sizes or dtypes"
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            return f"{listed} with pipeline parallelism: hybrid stages are not stored yet"
    for group in groups:
        quant = getattr(group.kv_cache_spec, "kv_quant_mode", None)
        if quant:  # quantized KV keeps scales beside the blocks, which pages would not carry
            return (
                f"quantized KV cache ({getattr(quant, 'name', quant)}): its scales are not stored"
            )
    return None


def hybrid_groups(kv_cache_config: KVCacheConfig | None) -> bool:
    """Whether the engine runs several KV-cache groups (vLLM's hybrid KV-cache manager
    with sliding-window or state-space layers): then each group has its own block ids
    per position and a sliding group's blocks below the window are the null block 0
    (``unsupported`` refuses every other kind of several groups)."""
    return kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1


def vllm_ranks() -> tuple[int, int]:
    """This worker's (PP rank, TP rank) in vLLM's process groups: what the connector's
    worker half asks when the engine registers its caches."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return get_pp_group().rank_in_group, get_tp_group().rank_in_group


def save_refusal(ns: Namespace) -> str | None:
    """Why an engine whose ranks' pages are ``ns`` (TP rank 0's; every rank holds as
    many heads) loads from the store but cannot save to it: each rank holds part of a
    head group, whose page needs heads another rank holds. None when it can save.
    ``KVStoreConnector`` asks once, at start; such an engine makes no saves and its
    scheduler says why in one WARNING line, where before every save failed and was
    counted."""
    if rank_units(ns).whole:
        return None
    lo, hi = ns.head_range
    return (
        f"head_groups {ns.groups} stores {ns.group_heads} KV heads in a page, and each of its "
        f"{ns.tp_size} TP ranks holds {hi - lo}: it loads whole pages but cannot write one "
        f"(head_groups {min(ns.tp_size, ns.total_heads)}, the default for this engine, or a "
        "multiple of it that divides the KV heads, the same on every engine sharing the pages, "
        "lets it save)"
    )
