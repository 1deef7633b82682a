"""A speculative draft's KV-cache layers, stored beside the target's under a namespace
of their own.

With ``draft_model`` (a second, smaller model) or an EAGLE/MTP head, vLLM puts the
draft's attention layers in the target's KV-cache group (``draft_model.model.layers.N``,
or ``model.layers.N`` past the target's last layer), so every block id of a request
holds the target's and the draft's KV of the same tokens. The connector stores the two
apart, with the same block hashes:

- the target's pages stay what every engine of the target model stores, so a plain
  engine and a speculating one share them;
- the draft's pages get the draft's namespace: for ``draft_model``, the namespace a
  plain engine of the draft model would use (its KV depends on its own weights and the
  tokens only); for EAGLE/MTP heads, which read the target's hidden states, the head's
  weights are keyed together with the target's.

Why store them at all: loading the target's pages alone is valid (verification keeps
the target's tokens) but measured useless: the draft then attends to stale blocks, and 1
of 183 drafted tokens was accepted where 48 of 48 were without the connector; with the
draft's pages loaded too, 48 of 48 (tests/vllm/test_vllm_specdec.py checks the last).

A hit is the shorter of the two prefixes. EAGLE/MTP heads write a block's last rows
from the token after it (vLLM's ``num_prefill_lookahead_tokens``), so, as vLLM's own
prefix cache does (``use_eagle_block_drop``), the blocks holding those rows are never
loaded: ``DraftFacts.drop_blocks``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from client.paging.loader import LoadOutcome, PageLoader, ids_from
from client.paging.paged_cache import PagedCache
from client.paging.specs import LoadSpec
from client.paging.staging_pool import StagingPool
from client.sync_client import KVCacheClient
from client.vllm.options import ConnectorOptions, engine_layout, model_namespace
from client.vllm.store import PageStore
from client.vllm.support import draft_layers
from client.vllm.weights import checkpoint_fingerprint, engine_weights
from kvstore.errors import KVStoreError
from kvstore.pages.layouts import detect_layout
from kvstore.pages.namespace import Namespace
from kvstore.settings.client import ClientOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftFacts:
    """What both sides of the connector know of an engine's draft: its KV-cache layers
    (names, in layer order), its method, and the trailing blocks of a stored prefix its
    pages cannot serve (0 for ``draft_model``)."""

    layers: list[str]
    method: str
    drop_blocks: int


def draft_facts(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> DraftFacts | None:
    """The engine's draft layers, or None when it has none (no speculation, ngram,
    suffix decoding). Read from the KV-cache groups' layer names, which the scheduler
    and the workers share, so both sides decide alike."""
    from vllm.model_executor.models.utils import extract_layer_index

    spec = vllm_config.speculative_config
    if spec is None or kv_cache_config is None:
        return None
    names = draft_layers(vllm_config, kv_cache_config)
    if not names:
        return None
    drop = 0
    if spec.use_eagle_block_drop():
        block = vllm_config.cache_config.block_size
        drop = -(-max(1, vllm_config.num_prefill_lookahead_tokens) // block)
    return DraftFacts(sorted(names, key=extract_layer_index), str(spec.method), drop)


def draft_refusal(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, facts: DraftFacts
) -> str | None:
    """Why the draft's layers cannot be stored beside the target's, or None."""
    what = f"speculative decoding ({facts.method}) with"
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return f"{what} pipeline parallelism: a draft's pages are not stored across stages yet"
    if len(kv_cache_config.kv_cache_groups) > 1:
        return f"{what} several KV-cache groups (hybrid attention): not stored there yet"
    spec = vllm_config.speculative_config
    draft = spec.draft_model_config if spec is not None else None
    if draft is None:
        return f"{what}out a draft model config"
    draft_tp = spec.draft_parallel_config.tensor_parallel_size if spec is not None else 0
    if draft_tp != vllm_config.parallel_config.tensor_parallel_size:
        return f"{what} a draft on {draft_tp} TP rank(s), not the target's every rank"
    if draft.use_mla != vllm_config.model_config.use_mla:
        return f"{what} a draft whose attention (MLA or not) differs from the target's"
    return None


def draft_namespace(
    vllm_config: VllmConfig,
    conf: ConnectorOptions,
    options: ClientOptions,
    facts: DraftFacts,
    *,
    layout: str,
    tp_rank: int,
) -> Namespace:
    """The namespace of the draft's pages for one TP rank (the draft runs on every rank
    of the target's PP stage; ``draft_refusal`` refuses PP)."""
    spec = vllm_config.speculative_config
    assert spec is not None and spec.draft_model_config is not None  # draft_facts found layers
    draft, parallel = spec.draft_model_config, spec.draft_parallel_config
    # The draft's own checkpoint names its weights (an operator's weights_revision
    # names the target's, and is added: a new revision may come with a new draft).
    weights = (
        checkpoint_fingerprint(draft.model, draft.revision)
        or f"id:{draft.model}@{draft.revision or 'default'}"
    )
    if options.weights_revision:
        weights = f"{weights[:120]} rev:{options.weights_revision[:120]}"
    if spec.use_eagle():  # the head reads the target's hidden states: its KV is theirs too
        weights = f"{weights[:120]} on {engine_weights(vllm_config, options)[:120]}"
    return model_namespace(
        vllm_config,
        conf,
        draft,
        parallel,
        name=f"{draft.model}"[:200],
        num_layers=len(facts.layers),
        layout=layout,
        tp_rank=tp_rank,
        weights=weights[:256],
    )


@dataclass
class DraftPages:
    """A speculative draft's layers on one worker: their client, paged cache, staging
    and loader, beside the target's; loads and saves use the same block ids."""

    client: PageStore
    cache: PagedCache
    staging: StagingPool
    loader: PageLoader

    @classmethod
    def build(
        cls,
        client: PageStore,
        cache: PagedCache,
        target: PageLoader,
        *,
        buffers: int,
        pages: int,
    ) -> DraftPages:
        """The draft's pages beside the ``target``'s loader: as many staging buffers of
        as many pages (every load and save moves both), the same load stream and
        credential handling, one KV-cache group. Called by the worker when the engine
        registers its caches."""
        staging = StagingPool(cache, buffers, pages, share="staging-draft")
        cache.warm()
        loader = target.beside(client, cache, staging)
        return cls(client, cache, staging, loader)

    def load_after(self, spec: LoadSpec, outcome: LoadOutcome, after: Any) -> LoadOutcome:
        """Loader thread, after the target's blocks of a load (``outcome``): the draft's
        of the same blocks; a block either failed is recomputed for both, and all of
        them when the scheduler found no draft pages."""
        if spec.draft_found is None:
            return LoadOutcome(ids_from(spec, spec.start_block), outcome.nbytes, outcome.seconds)
        drafted = self.loader.load(replace(spec, found=spec.draft_found), after)
        return LoadOutcome(
            sorted({*outcome.failed, *drafted.failed}),
            outcome.nbytes + drafted.nbytes,
            outcome.seconds + drafted.seconds,
        )


def draft_layout(vllm_config: VllmConfig, layers: list[torch.Tensor]) -> str:
    """The page layout of the draft's caches; raises ``KVStoreError`` when one differs
    from the first (every layer of a page has one shape)."""
    spec = vllm_config.speculative_config
    assert spec is not None and spec.draft_model_config is not None
    draft = spec.draft_model_config
    shapes = {tuple(layer.shape[1:]) for layer in layers}
    if len(shapes) != 1:
        raise KVStoreError(f"the draft's KV caches differ in shape: {sorted(shapes)}")
    return detect_layout(
        tuple(layers[0].shape),
        vllm_config.cache_config.block_size,
        draft.get_num_kv_heads(spec.draft_parallel_config),
        draft.get_head_size(),
        mla=draft.use_mla,
    )


def rank_draft_client(
    vllm_config: VllmConfig,
    conf: ConnectorOptions,
    options: ClientOptions,
    facts: DraftFacts,
    side: str,
    *,
    layout: str | None = None,
    tp_rank: int = 0,
    all_heads: bool = False,
) -> KVCacheClient:
    """A client for one rank's draft pages (``rank_client``'s counterpart; ``all_heads``:
    the scheduler's, for every head group). Logs one line naming the namespace."""
    spec = vllm_config.speculative_config
    assert spec is not None and spec.draft_model_config is not None
    if layout is None:  # the scheduler's view: draft_refusal keeps MLA alike on both models
        layout = engine_layout(vllm_config)
    ns = draft_namespace(vllm_config, conf, options, facts, layout=layout, tp_rank=tp_rank)
    if all_heads:
        ns = ns.storage
    client = KVCacheClient(None, ns, options=options)
    log.info(
        "KVStoreConnector (%s): the draft's %d layer(s) (%s) are stored under namespace %s (%s)",
        side,
        len(facts.layers),
        facts.method,
        ns.digest_hex,
        ns.model,
    )
    return client
