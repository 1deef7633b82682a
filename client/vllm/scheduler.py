"""The scheduler side of the connector: how much of a prompt the store holds, which
loads to start, which finished prefills to save.

``get_num_new_matched_tokens`` asks the index how many full blocks of the prompt are
stored (always leaving one prompt token to compute), waiting at most
``lookup_budget_ms``; past it, on an index fault, or while the circuit breaker is open
after repeated faults, the request is a miss. A hit is loaded asynchronously: the
request waits in WAITING_FOR_REMOTE_KVS while others keep running; or, with layer-wise
loads (GPU engines), in the step that computes the rest of its prompt, during the
forward pass.
``build_connector_meta`` hands the workers the loads to start and the saves of
requests whose prefill (possibly chunked) completed this step. When the engine
publishes KV events, each save's ``BlockStored`` is built here and published once
every worker stored its part (``client.vllm.events``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from client.log_limit import LogLimit
from client.lookups.stored_prefix import StoredPrefix
from client.vllm.claims import AnnouncedClaims
from client.vllm.events import StoredEvents
from client.vllm.identity import IdentityReader, KeyedPrompt, Unkeyable
from client.vllm.metadata import KVStoreConnectorMetadata, LoadSpec
from client.vllm.options import ConnectorOptions, lookup_breaker
from client.vllm.save_tracking import SaveTracker
from client.vllm.states import boundary_saves
from client.vllm.stats import StatsRecorder
from client.vllm.store import PrefixStore
from client.vllm.transfer_params import announcement, request_switch, wants_remote_decode
from kvstore.pages.identity import BlockExtras

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from client.vllm.feature_set import SchedulerFeatures

log = logging.getLogger(__name__)
# while the index is down every request would log it: at most a WARNING a minute
_LIMIT = LogLimit(log)


class ConnectorScheduler:
    """Scheduler-side state: loads found but not yet handed out, the blocks each load
    fills, requests to save, the lookup breaker. ``client`` is None when this engine
    does not load (a producer only); ``events`` is None unless the engine publishes
    KV events and this engine saves."""

    def __init__(
        self,
        conf: ConnectorOptions,
        client: PrefixStore | None,
        block_size: int,
        *,
        stats: StatsRecorder,
        features: SchedulerFeatures,
        events: StoredEvents | None = None,
    ) -> None:
        """``client``: the store of the engine's pages (None: a producer only);
        ``features``: what this engine's side does (``client.vllm.features``)."""
        self._conf = conf
        states = features.states
        self._states = states
        self._state_client = features.state_store
        # the KV-cache groups whose blocks make pages: attention's (every group but a
        # state-space hybrid's state groups)
        self._page_groups = list(states.page_groups) if states is not None else None
        # each request's last boundary (in blocks) whose state is stored or being saved:
        # its KV event names no block past it, as no engine could load one
        self._state_blocks: dict[str, int] = {}
        self._layerwise = features.layerwise
        self._draft = features.draft
        self._draft_drop = features.draft_drop
        self._hybrid = hybrid = features.hybrid
        self._claims_announcements = features.claims_announcements
        saves = features.saves
        self._client = client
        self._block_size = block_size
        self._saves_enabled = saves
        self._stats = stats
        self._pending_loads: dict[str, LoadSpec] = {}
        # P/D: prefixes prefill engines announced, claimed until the workers get them
        self._claims = AnnouncedClaims(block_size, conf.remote_prefill_wait_ms / 1000, stats)
        # req id -> the blocks a load fills: each position's block id in every group
        self._loaded_blocks: dict[str, list[tuple[int, ...]]] = {}
        self._saves = SaveTracker(
            block_size, hybrid=hybrid, events=events if saves else None, groups=self._page_groups
        )
        # Each request's prompt and identity, read once when vLLM first asks about it
        # (``get_num_new_matched_tokens``, before the request is first scheduled): its
        # lookups and its save key pages by both. A request vLLM never asked about, or
        # one whose identity kvstore cannot express, is neither looked up nor saved.
        self._identity = IdentityReader(block_size)
        self._keyed: dict[str, KeyedPrompt | None] = {}
        # Requests a load failed for compute the rest: asked again, the index would name
        # the same pages, and a fault that persists (a node refusing this engine's token,
        # one that stays registered but fails) looped load, fail, recompute, load again.
        self._load_failed: set[str] = set()
        self._breaker = lookup_breaker(conf)
        # With KV events on, each request vLLM asked about, until it is saved: its
        # save's event needs vLLM's block hashes, adapter and extra keys.
        self._events = events
        self._requests: dict[str, Request] = {}

    def _find(
        self, client: PrefixStore, tokens: list[int], extras: BlockExtras
    ) -> tuple[StoredPrefix, StoredPrefix | None, StoredPrefix | None] | None:
        """The stored prefix of ``tokens`` in ``client`` (the scheduler's own, passed by
        ``get_num_new_matched_tokens`` once it knows this side loads), the draft's of
        the same length when the engine stores a draft's pages, and a state-space
        hybrid's last state within it (the prefix then ends there); None (a miss) past
        the budget, on a fault or while the breaker is open. Never waits longer than the
        budget (plus the cancellation's unwinding), all lookups together."""
        if not self._breaker.allow():
            self._stats.count(lookups_skipped=1)
            return None
        budget = self._conf.lookup_budget_ms / 1000
        started = time.perf_counter()
        found = client.find(tokens, timeout=budget, identity=extras or None)
        draft_found = None
        if found is not None and self._draft is not None:
            draft_found, found = self._draft_prefix(
                found, tokens, extras, budget - (time.perf_counter() - started)
            )
        state_found = None
        if found is not None and self._state_client is not None:
            state_found, found = self._state_prefix(
                found, tokens, extras, budget - (time.perf_counter() - started)
            )
        seconds = time.perf_counter() - started
        self._breaker.record(found is not None)
        with self._stats.lock:
            self._stats.stats.add_counts(
                lookups=1,
                lookup_prompt_tokens=len(tokens),
                lookup_hit_tokens=found.tokens if found else 0,
                lookup_faults=found is None,
            )
            self._stats.stats.observe("lookup_seconds", seconds)
        if found is None and self._breaker.state != "closed":
            _LIMIT.warning(
                "breaker",
                "index lookups keep failing: every request is a miss for the next %.1f s",
                self._breaker.current_cooldown,
            )
        return None if found is None else (found, draft_found, state_found)

    def _state_prefix(
        self, found: StoredPrefix, tokens: list[int], extras: BlockExtras, budget: float
    ) -> tuple[StoredPrefix | None, StoredPrefix | None]:
        """The last state stored at a boundary within ``found`` and ``found`` cut there
        (no state: no blocks); (None, None) when the states' lookup could not answer."""
        assert self._state_client is not None
        if not found.blocks:
            return None, found
        if budget <= 0:
            return None, None
        state = self._state_client.find(
            tokens[: found.tokens], timeout=budget, identity=extras or None, last=True
        )
        if state is None:
            return None, None
        return (state if state.blocks else None), found.head(state.blocks)

    def _draft_prefix(
        self, found: StoredPrefix, tokens: list[int], extras: BlockExtras, budget: float
    ) -> tuple[StoredPrefix | None, StoredPrefix | None]:
        """The draft's stored prefix within the target's ``found``, and both cut to the
        blocks the two hold less ``draft_drop``; (None, None) when the draft's lookup
        could not answer (a fault like the target's). A target hit without the draft's
        pages is not taken: the draft would attend to stale blocks for the rest of the
        request (client.vllm.drafts)."""
        assert self._draft is not None
        if not found.blocks:
            return None, found
        if budget <= 0:
            return None, None
        drafted = self._draft.find(tokens[: found.tokens], timeout=budget, identity=extras or None)
        if drafted is None:
            return None, None
        blocks = max(min(found.blocks, drafted.blocks - self._draft_drop), 0)
        return drafted.head(blocks), found.head(blocks)

    def _keyed_prompt(self, request: Request) -> KeyedPrompt | None:
        """``request``'s prompt and identity, read the first time vLLM asks; None when
        kvstore cannot key it (counted once per request)."""
        if request.request_id not in self._keyed:
            try:
                self._keyed[request.request_id] = self._identity.keyed(request)
            except Unkeyable:
                self._keyed[request.request_id] = None
                self._stats.count(unkeyed_requests=1)
        return self._keyed[request.request_id]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        keyed = (
            self._keyed_prompt(request)
            if (self._client is not None or self._saves_enabled)
            else None
        )
        if self._events is not None and keyed is not None:
            self._requests[request.request_id] = request
        if self._client is None or keyed is None:
            return 0, False
        if (
            not request_switch(request.kv_transfer_params, "kvstore_load", request.request_id)
            or request.request_id in self._load_failed
        ):
            return 0, False
        prompt = keyed.tokens
        # always compute >= 1 token
        usable = (len(prompt) - 1) // self._block_size * self._block_size
        if usable <= num_computed_tokens:
            return 0, False
        # a P/D decode's prefix its prefill announced: claimed and waited for, not looked
        # up; hybrid, state-space and draft engines look up (their hits need more than
        # the attention pages an announcement names)
        if self._claims_announcements:
            claimed = self._claims.claim(request, keyed, usable, num_computed_tokens)
            if claimed is not None:
                return claimed
        pending = self._pending_loads.get(request.request_id)
        if pending is not None and pending.start_block * self._block_size == num_computed_tokens:
            # asked again while waiting for blocks: reuse
            answer: tuple[StoredPrefix, StoredPrefix | None, StoredPrefix | None] | None = (
                pending.found,
                pending.draft_found,
                pending.state_found,
            )
        else:
            answer = self._find(self._client, prompt[:usable], keyed.extras)
        new = (answer[0].tokens if answer else 0) - num_computed_tokens
        if answer is None or new <= 0:
            self._pending_loads.pop(request.request_id, None)
            return 0, False
        self._pending_loads[request.request_id] = LoadSpec(
            request.request_id,
            answer[0],
            [],
            num_computed_tokens // self._block_size,
            draft_found=answer[1],
            layerwise=self._layerwise,
            state_found=answer[2],
        )
        return new, not self._layerwise

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._claims.allocated(request, blocks, num_external_tokens):
            return
        spec = self._pending_loads.get(request.request_id)
        if spec is None:
            return
        if num_external_tokens == 0:
            del self._pending_loads[request.request_id]
            return
        hit = spec.found.blocks
        every = [list(ids)[:hit] for ids in blocks.get_block_ids()]
        groups = [every[g] for g in self._page_groups] if self._page_groups else every
        spec.block_ids = groups[0]
        if self._hybrid:
            spec.group_block_ids = groups
        if self._states is not None:  # each state group's block of the hit's last position
            spec.state_block_ids = [
                every[g][hit - 1] if len(every[g]) >= hit else 0 for g in self._states.state_groups
            ]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        for claimed in self._claims.take_allocated():
            meta.awaited.append(claimed)
            self._loaded_blocks[claimed.req_id] = [(b,) for b in claimed.block_ids]
        for req_id, spec in list(self._pending_loads.items()):
            if spec.block_ids:
                meta.loads.append(spec)
                if spec.state_found is not None:
                    self._state_blocks[req_id] = spec.found.blocks
                self._loaded_blocks[req_id] = list(zip(*(spec.group_block_ids or [spec.block_ids])))
                del self._pending_loads[req_id]
        if self._saves_enabled:
            self._saves.track(
                scheduler_output,
                loaded=lambda req_id: len(self._loaded_blocks.pop(req_id, [])),
                keyed=self._keyed.get,
            )
            if self._hybrid:
                meta.gathers.extend(self._saves.gathers(scheduler_output))
            if self._states is not None:
                states = boundary_saves(scheduler_output, self._states, self._saves.prompt_of)
                for state in states:
                    blocks = len(state.token_ids) // self._block_size
                    self._state_blocks[state.req_id] = max(
                        blocks, self._state_blocks.get(state.req_id, 0)
                    )
                meta.states.extend(states)
            meta.saves.extend(
                self._saves.finished_prefills(
                    scheduler_output,
                    meta.dropped,
                    lambda req_id: self._requests.pop(req_id, None),
                    self._announced if self._states is not None else None,
                )
            )
            meta.pins.extend(self._saves.take_pins())  # after those saves (client.vllm.pins)
        for req_id in scheduler_output.finished_req_ids:
            if self._saves.finish(req_id):
                meta.dropped.append(req_id)  # the worker holds its gathered pages
            self._forget(req_id)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks that failed to load (by block id, or a hybrid cache's by request) are
        recomputed, so they must be saved again; the workers' save outcomes count
        towards their events."""
        if self._events is not None and connector_output.kv_cache_events is not None:
            self._events.reported(connector_output.kv_cache_events)
        for req_id in connector_output.failed_recving:  # a hybrid cache's failed loads
            if req_id in self._loaded_blocks:  # vLLM recomputes the whole request
                self._loaded_blocks[req_id] = []
                self._load_failed.add(req_id)
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for req_id, blocks in self._loaded_blocks.items():
            bad = [i for i, ids in enumerate(blocks) if any(b in invalid for b in ids if b)]
            if bad:
                self._loaded_blocks[req_id] = blocks[: bad[0]]
                self._load_failed.add(req_id)

    def _announced(self, req_id: str, full: int) -> int:
        """A state-space hybrid's blocks its save's KV event names: up to its last
        boundary state (``client.vllm.states``)."""
        return min(full, self._state_blocks.get(req_id, 0))

    def _forget(self, req_id: str) -> None:
        self._state_blocks.pop(req_id, None)
        self._saves.finish(req_id)
        self._pending_loads.pop(req_id, None)
        self._claims.forget(req_id)
        self._loaded_blocks.pop(req_id, None)
        self._load_failed.discard(req_id)
        self._keyed.pop(req_id, None)
        self._requests.pop(req_id, None)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy their blocks out before the step ends, so blocks never outlive the
        # request; an in-flight load of an aborted request is waited for by vLLM itself
        # (it frees the blocks once get_finished reports the load). A prefill a proxy
        # asked to hand over (``do_remote_decode``) names what its save stores, for the
        # decode to wait for (``client.vllm.transfer_params``).
        params = None
        keyed = self._keyed.get(request.request_id)
        if wants_remote_decode(request.kv_transfer_params) and keyed is not None:
            blocks = self._saves.published_blocks(request.request_id)
            if blocks:
                params = announcement(self._block_size, keyed.tokens, keyed.extras, blocks)
        self._forget(request.request_id)
        return False, params

    def take_events(self) -> list[KVCacheEvent]:
        """The ``BlockStored`` events of saves every worker finished since the last call
        (vLLM's scheduler publishes them each step)."""
        return self._events.take_events() if self._events is not None else []

    def has_pending_events(self) -> bool:
        """Saves whose workers have not all answered: the engine keeps stepping until
        they have (bounded by ``OUTCOME_WAIT_S``), so their events are published even
        when no request is left to run."""
        return self._events is not None and self._events.waiting

    def shutdown(self) -> None:
        for client in (self._client, self._state_client, self._draft):
            if client is not None:
                client.close()
        self._client = self._state_client = self._draft = None
