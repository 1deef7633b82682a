"""The worker's side of a state-space hybrid's boundary states (``client.vllm.states``):
the state layers' caches, a state copied out of them at a boundary and published, and a
hit's state fetched and written into the block vLLM allocated for it. Used by
``client.vllm.worker.ConnectorWorker``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from client.gets.plan import spans_plan
from client.lookups.stored_prefix import StoredPrefix
from client.memory.buffers import Span, host_bytes
from client.paging.loader import LoadOutcome, ids_from
from client.paging.paged_cache import GatherResult
from client.paging.specs import LoadSpec, SaveSpec
from client.vllm.saver import SaveQueue
from client.vllm.states import StateFacts, StateSpec
from client.vllm.store import PageStore
from kvstore.errors import CredentialError, KVStoreError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


class StatePages:
    """Worker side: the state layers' caches (vLLM's int8 view of each,
    ``[num_blocks, 1, 1, padded bytes]``), copied out of and into one block per state
    group as one page ``[layers, 1, state bytes]``, and the rank's store of them."""

    def __init__(
        self,
        client: PageStore,
        layers: list[torch.Tensor],
        groups: list[int],
        state_bytes: int,
    ) -> None:
        """``groups``: each layer's index among the state groups (whose block it uses)."""
        _check_layers(layers, state_bytes)
        self.client = client
        self._layers = [layer.view(layer.shape[0], -1).view(torch.int8) for layer in layers]
        self._groups = groups
        self._bytes = state_bytes

    @classmethod
    def for_worker(
        cls,
        facts: StateFacts,
        kv_cache_config: KVCacheConfig,
        kv_caches: dict[str, torch.Tensor],
        open_store: Callable[[], PageStore],
    ) -> StatePages:
        """The state layers of ``kv_caches`` (``facts.state_layers``) and the rank's
        store of their states (``open_store``: ``WorkerStores.states``); raises
        ``KVStoreError`` (before any store is opened) for caches that cannot hold them."""
        missing = [n for n in facts.state_layers if n not in kv_caches]
        if missing:
            raise KVStoreError(f"the state layers' caches {missing[:2]} are not on this worker")
        layers = [kv_caches[n] for n in facts.state_layers]
        _check_layers(layers, facts.state_bytes)
        client = open_store()
        groups = [facts.state_group_of(n, kv_cache_config) for n in facts.state_layers]
        return cls(client, layers, groups, facts.state_bytes)

    @property
    def nbytes(self) -> int:
        return len(self._layers) * self._bytes

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """One page ``[1, layers, 1, bytes]`` in host memory: the state in ``block_ids``
        (one block per state group), copied now (engine thread, before vLLM may reuse
        the blocks)."""
        rows = [
            layer[block_ids[g], : self._bytes]
            for layer, g in zip(self._layers, self._groups, strict=True)
        ]
        return torch.stack(rows).to("cpu").view(1, len(rows), 1, self._bytes)

    def load_after(
        self, spec: LoadSpec, outcome: LoadOutcome, refused: Callable[[CredentialError], None]
    ) -> LoadOutcome:
        """Loader thread, after a load's attention pages (``outcome``): the hit's state at
        its last boundary. A load without it fails whole (vLLM recomputes the request:
        its attention pages alone would not resume the state layers); nothing it meets
        is raised (``refused``: a node refused the token)."""
        started = time.perf_counter()
        hit = spec.found.blocks
        try:
            arrived = (
                not outcome.failed
                and spec.state_found is not None
                and spec.state_found.blocks == hit
                and self.load(spec.state_found, spec.state_block_ids, hit - 1)
            )
        except CredentialError as exc:  # a load that fails is recomputed, never an engine error
            refused(exc)
            arrived = False
        except Exception as exc:
            log.warning("state of %s not loaded, its prompt is recomputed: %s", spec.req_id, exc)
            arrived = False
        seconds = outcome.seconds + time.perf_counter() - started
        if not arrived:
            return LoadOutcome(ids_from(spec, spec.start_block), outcome.nbytes, seconds)
        return LoadOutcome([], outcome.nbytes + self.nbytes, seconds)

    def save(self, state: StateSpec, saves: SaveQueue, block_size: int) -> None:
        """Engine thread: copy a boundary state out now (its blocks may be reused after
        this step) and publish it on the saver thread (``saves``), as the prefix's last
        block alone; its bytes count against ``max_pending_save_bytes`` as pages do."""
        if not self.client.namespace.stores_heads:  # a replicated state: rank 0 writes it
            return
        nbytes = self.nbytes
        if not saves.reserve(state.req_id, nbytes):
            return
        try:
            page = self.gather(state.block_ids)
        except Exception as exc:  # a state not copied is a future miss, never an engine error
            saves.release(nbytes)
            log.warning("state of %s not copied out, so it is not saved: %s", state.req_id, exc)
            return
        blocks = len(state.token_ids) // block_size
        spec = SaveSpec(
            state.req_id, state.token_ids, [], state.extras, gathered=True, start_block=blocks - 1
        )
        saves.submit(self.client, None, spec, GatherResult(page), nbytes, answers_event=False)

    def load(self, found: StoredPrefix, block_ids: list[int], boundary_block: int) -> bool:
        """Loader thread: fetch the state ``found`` (``KVCacheClient.find(last=True)``,
        block ``boundary_block``) and write it into ``block_ids`` (one per state group);
        False when it did not arrive (nothing written then)."""
        if not block_ids or 0 in block_ids:
            return False
        page = torch.empty((1, len(self._layers), 1, self._bytes), dtype=torch.int8)
        # one sink for the one page: a tensor of every block up to it would be needed otherwise
        got = self.client.read(
            spans_plan(found, [Span(host_bytes(page), 0, self.nbytes)], boundary_block)
        )
        if got <= boundary_block * self.client.namespace.block_size:
            return False
        for i, (layer, g) in enumerate(zip(self._layers, self._groups, strict=True)):
            layer[block_ids[g], : self._bytes].copy_(page[0, i, 0])
        return True


def _check_layers(layers: list[torch.Tensor], state_bytes: int) -> None:
    """Raise ``KVStoreError`` unless every state layer's cache holds ``state_bytes`` per block."""
    for layer in layers:
        if layer.dim() < 2 or layer[0].numel() * layer.element_size() < state_bytes:
            raise KVStoreError(
                f"a state layer's cache {tuple(layer.shape)} ({layer.dtype}) does not hold "
                f"{state_bytes} bytes per block"
            )
