"""The connector's KV events: ``BlockStored`` for the blocks a save put in the store,
published by the engine's own publisher (so with the engine's topic, endpoint,
sequence numbers and data-parallel rank).

vLLM 0.32 collects a connector's events in two halves: each worker's
``get_kv_connector_kv_cache_events`` result travels in its ``KVConnectorOutput``
(``KVOutputAggregator`` merges the workers' with ``add_events`` and
``increment_workers``), the scheduler's ``update_connector_output`` receives the merged
object, and ``take_events`` hands the scheduler's events to its publisher each step.

Here the halves split the work by what each knows:

- The scheduler knows the request: its vLLM block hashes, token ids, adapter and
  extra keys. When it hands a save to the workers it builds the event and keeps it
  (``StoredEvents.expect``), giving the save an ``event_id``.
- Each worker knows whether its part of the save was stored: every page of it on
  some node (``PublishReport.refused == 0``). It reports ``(event_id, ok)`` once per
  save it was given, whatever happened (``SaveOutcomeLog``): stored, failed, dropped,
  or nothing to store on this rank (MLA's replicated latent, saved by another rank).
- The scheduler publishes an event once every worker reported its save, and only
  if all said ok: with tensor or pipeline parallelism a block is loadable only
  when every rank's part of it is stored. A save that some rank could not store
  wholly announces nothing (counted in ``events_withheld``), since which of its
  pages the store holds is not known.

Fields (the same as vLLM's own ``BlockStored``, docs/router-integration.md):
``block_hashes`` are vLLM's hashes of the saved blocks (as the engine's own events
give them: bytes, or ints under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) from block 0 in
prefix order, ``parent_block_hash`` None, ``token_ids`` the blocks' tokens,
``block_size`` the engine's, ``lora_id``/``lora_name``/``extra_keys``/``session_id``
as vLLM sets them, ``group_idx`` 0, ``medium`` "CPU" (a save lands in a storage
node's memory; the node itself announces a later move to disk), ``locality``
"REMOTE" (the memory is a storage node's, not this engine's), ``ownership``
"kvstore". Under the ``dynamo`` profile (``kv_events_profile``,
kvstore.events.profiles) the hashes are ints and neither mark is set, so Dynamo's
indexer keeps the events. The whole chain is announced each time, so a router that missed or
forgot an earlier save's event still sees every parent first.

No ``BlockRemoved`` comes from here: a storage node evicts or demotes pages on its
own and tells no engine, so an engine cannot know when its announced blocks leave
the store. The nodes' own event stream (``kvstore.events``) is where removals are
published."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, KVCacheEvent, KVConnectorKVEvents

from client.vllm.metadata import SaveSpec
from client.vllm.stats import StatsRecorder
from kvstore.events.profiles import PROFILES, EventProfile, u64_hash

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
# A save whose workers have not all answered after this long announces nothing (a
# save is bounded by the client's timeout; this only keeps a lost answer from
# holding the event, and the engine awake, forever).
OUTCOME_WAIT_S = 60.0
# Events waiting for their workers' answers, at most (past it the oldest is given up).
MAX_PENDING = 10_000


@dataclass(frozen=True)
class SaveOutcome:
    """One worker's answer for one save: was every page of its part stored."""

    event_id: int
    ok: bool


class SaveOutcomes(KVConnectorKVEvents):
    """What workers send the scheduler through ``KVConnectorOutput.kv_cache_events``:
    save outcomes, not vLLM events (the scheduler turns them into events). Merged
    across workers by vLLM's ``KVOutputAggregator``; plain data, so it pickles
    between processes."""

    def __init__(self, outcomes: list[SaveOutcome] | None = None) -> None:
        self._outcomes = list(outcomes or [])
        self._workers = 1

    def add_events(self, events: list[Any]) -> None:
        self._outcomes.extend(events)

    def aggregate(self) -> SaveOutcomes:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._outcomes)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._outcomes.clear()
        self._workers = 1

    def __repr__(self) -> str:
        return f"<SaveOutcomes {len(self._outcomes)} from {self._workers} worker(s)>"


class SaveOutcomeLog:
    """Worker side: outcomes of the saves given to this worker, until the engine step
    collects them. ``report`` is called by the engine step and the saver thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: list[SaveOutcome] = []

    def report(self, specs: list[SaveSpec], ok: bool) -> None:
        """Record ``ok`` for each of ``specs`` that expects an outcome (has an event id)."""
        answers = [SaveOutcome(spec.event_id, ok) for spec in specs if spec.event_id is not None]
        if answers:
            with self._lock:
                self._outcomes.extend(answers)

    def take_outcomes(self) -> SaveOutcomes | None:
        """What was recorded since the last call; None when nothing was."""
        with self._lock:
            if not self._outcomes:
                return None
            taken, self._outcomes = self._outcomes, []
        return SaveOutcomes(taken)


@dataclass
class _Pending:
    event: BlockStored
    answers: int
    ok: bool
    since: float


class StoredEvents:
    """Scheduler side: the events of saves handed to workers, published once every
    one of ``reporters`` workers (the engine's TP x PP world size) answered ok.
    Used only when the engine publishes KV events (``kv_events_config``)."""

    def __init__(
        self,
        block_size: int,
        reporters: int,
        *,
        kv_cache_config: KVCacheConfig | None,
        stats: StatsRecorder,
        profile: EventProfile = PROFILES["vllm"],
    ) -> None:
        self._block_size = block_size
        self._profile = profile
        # Read when a save is announced: the engine core resolves the config's
        # hash_block_size after it creates the connector.
        self._kv_cache_config = kv_cache_config
        # the KV-cache group the pages are of: the first attention group (a state-space
        # hybrid's group 0 may hold its states)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        self._group = next((g for g, kind in enumerate(kinds) if kind != "MambaSpec"), 0)
        # vLLM's maybe_convert_block_hash reads this variable for every block (3 µs each:
        # 0.4 ms of the scheduler's step for an 8,192-token prompt); read once, it cannot
        # change under a running engine. The conversion is vLLM's (tests compare).
        from vllm import envs

        self._int_hashes = profile.int_hashes or bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        self._reporters = reporters
        self._stats = stats
        self._ids = itertools.count()
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def expect(self, request: Request, token_ids: list[int], blocks: int) -> int | None:
        """Build the event of saving ``request``'s first ``blocks`` full blocks
        (``token_ids``: their tokens) and return the id its save carries to the
        workers; None when vLLM has not hashed that many blocks (nothing to announce)."""
        from vllm.v1.core.kv_cache_utils import resolve_block_hashes

        hash_block_size = (
            getattr(self._kv_cache_config, "hash_block_size", None) or self._block_size
        )
        hashes = resolve_block_hashes(request.block_hashes, hash_block_size, self._block_size)
        if len(hashes) < blocks:
            return None
        lora = request.lora_request
        event = BlockStored(
            block_hashes=[
                u64_hash(hashes[i]) if self._int_hashes else hashes[i] for i in range(blocks)
            ],
            parent_block_hash=None,
            token_ids=token_ids,
            block_size=self._block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_CPU,
            lora_name=lora.name if lora else None,
            extra_keys=_extra_keys(request, blocks, self._block_size),
            group_idx=self._group,
            locality=self._profile.remote,
            ownership=self._profile.ownership,
            session_id=getattr(request, "session_id", None),
        )
        event_id = next(self._ids)
        self._pending[event_id] = _Pending(event, 0, True, time.monotonic())
        while len(self._pending) > MAX_PENDING:
            self._give_up(self._pending.popitem(last=False)[1])
        return event_id

    def reported(self, outcomes: Any) -> None:
        """Count the workers' answers in ``outcomes`` (a ``SaveOutcomes``; anything
        else is ignored); an event all workers answered is published (all ok) or
        withheld."""
        if not isinstance(outcomes, SaveOutcomes):
            return
        for outcome in outcomes.get_all_events():
            pending = self._pending.get(outcome.event_id)
            if pending is None:
                continue  # given up already
            pending.answers += 1
            pending.ok = pending.ok and outcome.ok
            if pending.answers >= self._reporters:
                del self._pending[outcome.event_id]
                if pending.ok:
                    self._ready.append(pending.event)
                    self._stats.count(event_blocks=len(pending.event.block_hashes))
                else:
                    self._stats.count(events_withheld=1)

    def take_events(self) -> list[KVCacheEvent]:
        """The events ready since the last call (the scheduler's ``take_events``),
        after giving up on saves unanswered for ``OUTCOME_WAIT_S``."""
        if self._pending:
            now = time.monotonic()
            while self._pending:
                oldest = next(iter(self._pending.values()))
                if now - oldest.since < OUTCOME_WAIT_S:
                    break
                self._give_up(self._pending.popitem(last=False)[1])
        ready, self._ready = self._ready, []
        return ready

    @property
    def waiting(self) -> bool:
        """Some save's answers are still to come (keeps the engine stepping)."""
        return bool(self._pending)

    def _give_up(self, pending: _Pending) -> None:
        self._stats.count(events_withheld=1)
        log.warning(
            "a save's outcome did not arrive from every worker; its %d blocks are not announced",
            len(pending.event.block_hashes),
        )


def _extra_keys(
    request: Request, blocks: int, block_size: int
) -> list[tuple[Any, ...] | None] | None:
    """vLLM's per-block extra keys of ``request`` as its own events publish them
    (untagged); None for a request with none (no adapter, images, salt or embeddings)."""
    if not (
        request.lora_request
        or request.mm_features
        or request.cache_salt
        or request.prompt_embeds is not None
    ):
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    keys, mm = [], 0
    for i in range(blocks):
        key, mm = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm)
        keys.append(key)
    return to_event_extra_keys(keys)
