"""Pins of what a request saves (``kv_transfer_params`` ``kvstore_pin``,
``client.vllm.transfer_params.pin_request``): its prompt's first full blocks stay in the
storage nodes' memory, for a TTL or until unpinned (a system prompt every request
shares, say), however many other prompts come after it.

The two halves split the work as the saves do:

- The scheduler knows the request: its prompt, its identity resolved to blocks (LoRA,
  salt, weights revision, multimodal items, embeddings: ``client.vllm.identity``) and
  when its prefill completed. In that step's metadata it hands each worker a
  ``PinSpec`` (``pin_of``, from ``client.vllm.save_tracking``), beside the request's
  last save, or alone when the prompt was stored already (loaded, or saved in chunks).
- Each worker knows when its saves are published: it pins once every save it was
  handed before the pin is (``PinQueue``), so a pin never runs ahead of the pages it
  names. It pins with the clients it saved through (the engine's pages, a draft's, a
  state-space hybrid's boundary states), under the same identity, so the pin names the
  very pages the saves stored. With TP each rank pins after its own saves: the block
  hashes are the same on every rank, so the last rank's pin finds every head group's
  page of the prefix.

A pin goes out on a thread of its own, never on the engine step or the saver thread (a
node that is slow to answer holds up neither). A pin that fails (refused for the nodes'
pin limits or the token, a node unreachable, none of its pages found) is counted
(``vllm:kvstore_pin_failures_total``) and logged at WARNING at most once a minute; it
never fails the request, which has its tokens before the pin is even sent."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from client.log_limit import LogLimit
from client.vllm.transfer_params import PIN_PARAM, PinAsk
from kvstore.control.reports import ControlReport
from kvstore.pages.identity import NO_EXTRAS, BlockExtras

if TYPE_CHECKING:  # vLLM's types: metadata, which carries PinSpec, loads without vLLM
    from client.vllm.stats import StatsRecorder

log = logging.getLogger(__name__)
# a node down fails every pin: a WARNING a minute, the others at DEBUG
_LIMIT = LogLimit(log)
# Longest a worker's shutdown waits for pins still to send (vLLM gives a worker 5 s
# after SIGTERM, and the saves had theirs): the rest are not sent, and said so.
SHUTDOWN_WAIT_S = 2.0


@dataclass(frozen=True)
class PinSpec:
    """Pin the full blocks of ``token_ids`` (a multiple of the block size) under
    ``extras``, for ``ttl_s`` seconds (None: until unpinned)."""

    req_id: str
    token_ids: list[int]
    extras: BlockExtras = NO_EXTRAS
    ttl_s: float | None = None


def pin_of(
    req_id: str,
    ask: PinAsk,
    prompt: list[int],
    extras: BlockExtras,
    block_size: int,
    stored_blocks: int,
) -> PinSpec | None:
    """Scheduler thread: what a request that asked for ``ask`` pins once its prefill
    completed and its save stores (or the store holds) ``stored_blocks`` full blocks of
    ``prompt``: those within ``ask.tokens`` tokens (all of them when None). None, logged,
    when that is no whole block."""
    blocks = stored_blocks if ask.tokens is None else min(stored_blocks, ask.tokens // block_size)
    if blocks <= 0:
        log.warning(
            "request %s: kv_transfer_params[%r] names no full block of %d tokens "
            "(tokens %s, the prompt's %d tokens); nothing pinned",
            req_id,
            PIN_PARAM,
            block_size,
            ask.tokens,
            len(prompt),
        )
        return None
    return PinSpec(req_id, prompt[: blocks * block_size], extras, ask.ttl_s)


class Pinner(Protocol):
    """What a worker pins through: its ``KVCacheClient`` (one per namespace it saves)."""

    def pin(
        self, token_ids: Any, *, identity: BlockExtras | None = None, ttl_s: float | None = None
    ) -> ControlReport: ...


class PinQueue:
    """Worker side: the pins handed over and not yet answered, sent on one thread of
    their own (``kvstore-pin``) in the order the scheduler handed them over."""

    def __init__(self, stats: StatsRecorder) -> None:
        self._stats = stats
        # no thread until the first pin (ThreadPoolExecutor starts them on submit)
        self._pinner = ThreadPoolExecutor(1, thread_name_prefix="kvstore-pin")
        self.in_flight: set[Future] = set()

    def after(
        self, pins: Sequence[PinSpec], saves: Collection[Future], clients: Sequence[Pinner]
    ) -> None:
        """Engine thread, once the step's saves are handed to the saver: each of
        ``pins`` through every one of ``clients``, once ``saves`` (the saves in flight,
        this step's among them) are published. Returns at once."""
        if not pins or not clients:
            return
        before = list(saves)  # a snapshot: later saves do not hold these pins up
        for pin in pins:
            future = self._pinner.submit(self._pin, pin, before, list(clients))
            self.in_flight.add(future)
            future.add_done_callback(self.in_flight.discard)

    def _pin(self, pin: PinSpec, saves: list[Future], clients: list[Pinner]) -> None:
        """Pin thread: wait for the saves, then pin through each client. A pin that
        raised (a refusal: the nodes' pin limits, the token; no answer in time), left a
        node unreachable, or found none of its pages on any node is counted and
        logged, once per request."""
        wait_futures(saves)  # each bounded by the client's timeout; publish never raises
        pages, problems = 0, []
        for client in clients:
            try:
                report = client.pin(pin.token_ids, identity=pin.extras or None, ttl_s=pin.ttl_s)
            except Exception as exc:
                problems.append(f"{type(exc).__name__}: {exc}")
                continue
            pages += report.pages
            problems += [
                f"node {node} unreachable ({why})" for node, why in report.unreachable.items()
            ]
        if not problems and not pages:
            problems.append("no node held its pages (not stored, or evicted already)")
        if problems:
            self._stats.count(pin_failures=1)
            _LIMIT.warning(
                "failed",
                "pin of request %s's first %d tokens failed (counted in "
                "vllm:kvstore_pin_failures_total; the request is unaffected): %s",
                pin.req_id,
                len(pin.token_ids),
                "; ".join(problems),
            )
            return
        self._stats.count(pins=1)
        log.debug("pinned %d pages of request %s", pages, pin.req_id)

    def shutdown(self) -> None:
        """Send the pins handed over, waiting at most ``SHUTDOWN_WAIT_S``; those not sent
        by then are dropped, and logged. Called after the saves' own shutdown (which
        publishes the saves the pins wait for), before the clients close."""
        pending = list(self.in_flight)
        if pending:
            wait_futures(pending, timeout=SHUTDOWN_WAIT_S)
        left = sum(not future.done() for future in pending)
        self._pinner.shutdown(wait=False, cancel_futures=True)
        if left:
            log.warning("%d pin(s) not sent before shutdown: their pages stay evictable", left)
