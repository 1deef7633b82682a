"""What ``client.vllm.worker.ConnectorWorker`` is built with, decided once at engine
start by ``KVStoreConnector`` (or a test): ``WorkerFeatures`` (what the worker does on
this engine) and ``WorkerStores`` (how it opens the stores it loads from and saves to,
one per namespace: the engine's pages, a draft's, a state-space hybrid's states).

Guarantees: the worker asks nothing of a store beyond ``client.vllm.store.PageStore``,
and opens every store through ``WorkerStores``: a ``KVCacheClient`` each (logging the
start lines an operator reads) unless the caller handed an opener of its own (the fast
tests' in-memory store, ``tests/support/memory_store.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from client.memory.device_pages import DeviceCopier, default_copier
from client.stats import ClientStats
from client.vllm.drafts import DraftFacts, draft_namespace, rank_draft_client
from client.vllm.options import ConnectorOptions, engine_namespace, rank_client
from client.vllm.states import StateFacts, rank_state_client, state_namespace
from client.vllm.store import PageStore, PageStoreOpener
from client.vllm.weights import engine_weights
from kvstore.settings.client import ClientOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class WorkerFeatures:
    """The worker side's features (the defaults: an engine of attention pages alone).

    - ``enabled``: the engine can use the store (``client.vllm.support.unsupported``
      and the other refusals found nothing); False: the worker never loads or saves,
      and reports every load it is given failed;
    - ``drafts``: a speculative draft's layers (``client.vllm.drafts``), loaded and
      saved beside the target's blocks under a namespace of their own;
    - ``states``: a state-space hybrid's groups (``client.vllm.states``): its boundary
      states are saved, and a hit loads the state at its last boundary.

    Several KV-cache groups (hybrid attention) are read off the ``KVCacheConfig``."""

    enabled: bool = True
    drafts: DraftFacts | None = None
    states: StateFacts | None = None


class WorkerStores:
    """Opens one worker's stores when its caches are registered (the layout and ranks
    are known only then). ``opener``: the caller's, by namespace; None: a
    ``KVCacheClient`` each, built with ``device`` (the device copier:
    ``client.memory.device_pages``; a test hands ``HostCopier``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        conf: ConnectorOptions,
        options: ClientOptions,
        *,
        opener: PageStoreOpener | None = None,
        device: Callable[[ClientStats], DeviceCopier | None] = default_copier,
    ) -> None:
        self._vllm_config = vllm_config
        self._conf = conf
        self._options = options
        self._opener = opener
        self._device = device

    def engine(
        self, *, layout: str, tp_rank: int, pp_rank: int, page_layers: int | None
    ) -> PageStore:
        """The store of this rank's share of the engine's pages (``page_layers``: a
        state-space hybrid's attention layers, as ``engine_namespace``'s)."""
        config, conf, options = self._vllm_config, self._conf, self._options
        if self._opener is None:
            return rank_client(
                config,
                conf,
                options,
                "WORKER",
                layout=layout,
                tp_rank=tp_rank,
                pp_rank=pp_rank,
                device=self._device,
                page_layers=page_layers,
            )
        weights = engine_weights(config, options)
        return self._opener(
            engine_namespace(
                config,
                conf,
                layout=layout,
                tp_rank=tp_rank,
                pp_rank=pp_rank,
                weights=weights,
                page_layers=page_layers,
            )
        )

    def draft(self, facts: DraftFacts, *, layout: str, tp_rank: int) -> PageStore:
        """The store of this rank's share of a speculative draft's pages."""
        config, conf, options = self._vllm_config, self._conf, self._options
        if self._opener is None:
            return rank_draft_client(
                config, conf, options, facts, "WORKER", layout=layout, tp_rank=tp_rank
            )
        return self._opener(
            draft_namespace(config, conf, options, facts, layout=layout, tp_rank=tp_rank)
        )

    def states(self, facts: StateFacts, *, tp_rank: int) -> PageStore:
        """The store of this rank's share of a state-space hybrid's boundary states."""
        config, conf, options = self._vllm_config, self._conf, self._options
        if self._opener is None:
            return rank_state_client(config, conf, options, facts, "WORKER", tp_rank=tp_rank)
        return self._opener(state_namespace(config, conf, options, facts, tp_rank=tp_rank))
