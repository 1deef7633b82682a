"""Which finished prefills the connector saves: the requests it may save, their block
lists as they grow, with several KV-cache groups (hybrid) the blocks to copy out in the
step they become full, and the pins of saved prompts (``SaveTracker``).

Used by ``client.vllm.scheduler.ConnectorScheduler`` on the engine's scheduler thread,
once per step in ``build_connector_meta``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from client.vllm.events import StoredEvents
from client.vllm.identity import KeyedPrompt
from client.vllm.metadata import GatherSpec, PinSpec, SaveSpec
from client.vllm.pins import pin_of
from client.vllm.transfer_params import PIN_PARAM, PinAsk, pin_request, request_switch
from kvstore.pages.identity import BlockExtras

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class Tracked:
    """A request the connector may save: its prompt, its identity resolved to blocks,
    and its blocks as they grow, per KV-cache group (one group unless hybrid). Hybrid:
    ``gathered`` pages were copied out step by step, from ``base`` (set at the first
    gather: past the blocks loaded and past any null block); ``broken`` once a position
    past ``base`` had the null block in some group, from which on nothing is gathered
    and the request is not saved."""

    prompt: list[int]
    extras: BlockExtras
    block_ids: list[list[int]]
    stored_blocks: int = 0
    saved: bool = False
    gathered: int = 0
    broken: bool = False
    base: int | None = None
    # One KV-cache group, no KV events: the blocks a chunked prefill's earlier steps
    # saved already, from the first on (``SaveTracker.finished_prefills``).
    chunks_saved: int = 0
    pin: PinAsk | None = None  # kv_transfer_params' kvstore_pin (client.vllm.pins)

    @property
    def holding(self) -> bool:
        """Whether a worker holds pages gathered for this request (hybrid groups)."""
        return self.gathered > (self.base or 0)


class SaveTracker:
    """The requests the connector may save, from their first scheduling to their save
    (or their end). ``events``: the engine's KV events of saves, or None."""

    def __init__(
        self,
        block_size: int,
        *,
        hybrid: bool,
        events: StoredEvents | None,
        groups: list[int] | None = None,
    ) -> None:
        """``groups``: the KV-cache groups whose blocks make pages (None: every group; a
        state-space hybrid's state groups are saved apart, ``client.vllm.states``)."""
        self._block_size = block_size
        self._hybrid = hybrid
        self._events = events
        self._groups = groups
        self._tracked: dict[str, Tracked] = {}
        self._pinning: list[str] = []  # saved this step, asking for a pin

    def _pages(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """The block ids of the groups whose blocks make pages."""
        if self._groups is None:
            return [list(group) for group in block_ids]
        return [list(block_ids[g]) for g in self._groups]

    def prompt_of(self, req_id: str) -> tuple[list[int], BlockExtras] | None:
        """A tracked request's prompt and identity (None: the connector does not save it)."""
        tracked = self._tracked.get(req_id)
        return None if tracked is None else (tracked.prompt, tracked.extras)

    def track(
        self,
        scheduler_output: SchedulerOutput,
        *,
        loaded: Callable[[str], int],
        keyed: Callable[[str], KeyedPrompt | None],
    ) -> None:
        """Follow the block lists of scheduled requests (for their saves). ``loaded``:
        how many blocks a newly scheduled request loaded (asked once);
        ``keyed``: its prompt and identity, None when it cannot be keyed."""
        for new in scheduler_output.scheduled_new_reqs:
            stored = loaded(new.req_id)
            prompt = keyed(new.req_id)
            extra = new.sampling_params.extra_args if new.sampling_params is not None else None
            params = (extra or {}).get("kv_transfer_params")
            if prompt is None or not request_switch(params, "kvstore_save", new.req_id):
                if prompt is not None and pin_request(params, new.req_id) is not None:
                    log.warning(
                        "request %s: kv_transfer_params[%r] ignored: kvstore_save is false, "
                        "and a pin keeps what the request saves",
                        new.req_id,
                        PIN_PARAM,
                    )
                continue  # never tracked: nothing gathered or published
            self._tracked[new.req_id] = Tracked(
                prompt.tokens,
                prompt.extras,
                self._pages(new.block_ids),
                stored,
                pin=pin_request(params, new.req_id),
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            new_blocks = cached.new_block_ids[i]
            if tracked is None or new_blocks is None:
                continue
            if req_id in cached.resumed_req_ids:  # preempted and resumed: a fresh block list
                tracked.block_ids = self._pages(new_blocks)
            else:
                for group, more in zip(tracked.block_ids, self._pages(new_blocks), strict=True):
                    group.extend(more)

    def gathers(self, scheduler_output: SchedulerOutput) -> list[GatherSpec]:
        """Hybrid groups: the prompt blocks of tracked requests that become full with
        this step, to copy out before the step ends. A sliding group's block is freed
        when vLLM next schedules the request once the block left the window (and may then
        hold another request's KV), so a save at the prompt's end could not gather it."""
        computed_after = _computed_after_step(scheduler_output)
        gathers = []
        for req_id, tracked in self._tracked.items():
            computed = computed_after.get(req_id)
            if computed is None or tracked.saved or tracked.broken:
                continue
            full = min(computed, len(tracked.prompt)) // self._block_size
            if tracked.base is None:
                tracked.base = tracked.gathered = _save_base(tracked, full)
            if full <= tracked.gathered:
                continue
            ids = [group[tracked.gathered : full] for group in tracked.block_ids]
            if any(len(group) < full - tracked.gathered or 0 in group for group in ids):
                tracked.broken = True  # a null block past the base: no whole page
                continue
            blocks = len(tracked.prompt) // self._block_size
            gathers.append(GatherSpec(req_id, tracked.gathered, blocks, ids, tracked.base))
            tracked.gathered = full
        return gathers

    def finished_prefills(
        self,
        scheduler_output: SchedulerOutput,
        dropped: list[str],
        request_of: Callable[[str], Request | None],
        announce: Callable[[str, int], int] | None = None,
    ) -> list[SaveSpec]:
        """The saves of tracked requests whose prefill (possibly over several chunks)
        completes with this step, each once. Hybrid: only of requests whose every page
        was gathered; the others' gathered pages are ``dropped``. ``request_of``: the
        request vLLM asked about (for its save's KV event), given once; ``announce``:
        how many of a request's ``full`` blocks its event may name (a state-space
        hybrid's: up to its last boundary state stored), all of them when None."""
        computed_after = _computed_after_step(scheduler_output)
        saves = []
        for req_id, tracked in self._tracked.items():
            computed = computed_after.get(req_id)
            if tracked.saved or computed is None:
                continue
            if computed < len(tracked.prompt):
                chunk = self._chunk(req_id, tracked, computed)
                if chunk is not None:
                    saves.append(chunk)
                continue
            tracked.saved = True
            if tracked.pin is not None:
                self._pinning.append(req_id)
            full = len(tracked.prompt) // self._block_size
            base = tracked.base or 0
            if self._hybrid and (tracked.broken or tracked.gathered < full or base >= full):
                if tracked.holding:
                    dropped.append(req_id)
                continue
            if full > max(tracked.stored_blocks, tracked.chunks_saved):
                tokens = tracked.prompt[: full * self._block_size]
                request = request_of(req_id)
                named = full if announce is None else announce(req_id, full)
                event_id = (
                    self._events.expect(request, tokens[: named * self._block_size], named)
                    if self._events is not None and request is not None and named > 0
                    else None
                )
                if self._hybrid:
                    saves.append(
                        SaveSpec(
                            req_id,
                            tokens,
                            [],
                            tracked.extras,
                            event_id,
                            gathered=True,
                            start_block=base,
                        )
                    )
                else:
                    start = tracked.chunks_saved  # the earlier chunks' blocks are stored
                    saves.append(
                        SaveSpec(
                            req_id,
                            tokens,
                            tracked.block_ids[0][start:full],
                            tracked.extras,
                            event_id,
                            start_block=start,
                        )
                    )
            elif tracked.holding:
                dropped.append(req_id)
        return saves

    def _chunk(self, req_id: str, tracked: Tracked, computed: int) -> SaveSpec | None:
        """A chunked prefill's blocks that became full with this step, saved now rather
        than after its last chunk: a decode waiting for the prompt (P/D) then waits
        for the last chunk's save only. One KV-cache group and no KV events only (a
        hybrid's pages are gathered and published whole; an event names a whole save)."""
        if self._hybrid or self._events is not None:
            return None
        full = computed // self._block_size
        start = max(tracked.chunks_saved, tracked.stored_blocks)
        if full <= start:
            return None
        tracked.chunks_saved = full
        return SaveSpec(
            req_id,
            tracked.prompt[: full * self._block_size],
            tracked.block_ids[0][start:full],
            tracked.extras,
            start_block=start,
        )

    def take_pins(self) -> list[PinSpec]:
        """The pins of requests whose saves ``finished_prefills`` just handed over (or
        whose prompt the store held already), each once; a request whose pages could
        not all be saved (a hybrid's, broken) pins nothing."""
        pins = []
        for req_id in self._pinning:
            tracked = self._tracked.get(req_id)
            blocks = self.published_blocks(req_id)
            if tracked is None or tracked.pin is None or not blocks:
                continue
            pin = pin_of(
                req_id, tracked.pin, tracked.prompt, tracked.extras, self._block_size, blocks
            )
            if pin is not None:
                pins.append(pin)
        self._pinning.clear()
        return pins

    def published_blocks(self, req_id: str) -> int:
        """The full prompt blocks a tracked request's save stores (handed to a worker, or
        stored already: loaded), 0 when it has none (not tracked, prefill unfinished,
        or a hybrid request whose pages could not all be gathered)."""
        tracked = self._tracked.get(req_id)
        if tracked is None or not tracked.saved or tracked.broken:
            return 0
        full = len(tracked.prompt) // self._block_size
        if self._hybrid and tracked.gathered < full and tracked.stored_blocks < full:
            return 0
        return full

    def finish(self, req_id: str) -> bool:
        """Stop tracking a finished request; True when a worker holds pages gathered for
        it that no save will publish (the worker must drop them)."""
        tracked = self._tracked.pop(req_id, None)
        return tracked is not None and tracked.holding and not tracked.saved


def _save_base(tracked: Tracked, full: int) -> int:
    """Hybrid groups: the first block a request's save gathers. Blocks it loaded are
    stored already, and below a sliding window after a hit (loaded, or vLLM's own
    prefix cache) that group holds the null block: no whole page of those positions
    exists, so the save starts past the last of them (``put_pages(start_block=)``)."""
    nulls = [i for group in tracked.block_ids for i, block in enumerate(group[:full]) if block == 0]
    return max(tracked.stored_blocks, max(nulls, default=-1) + 1)


def _computed_after_step(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """Tokens each scheduled request will have computed once this step has run."""
    before = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens))
    scheduled = scheduler_output.num_scheduled_tokens
    return {
        req_id: done + scheduled[req_id] for req_id, done in before.items() if req_id in scheduled
    }
