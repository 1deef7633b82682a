"""``SchedulerFeatures``: what the connector's scheduler side does on this engine,
decided once at engine start (by ``client.vllm.features.build_scheduler``, or a test)
and taken as it is by ``ConnectorScheduler`` (client.vllm.scheduler)."""

from __future__ import annotations

from dataclasses import dataclass

from client.vllm.states import StateFacts
from client.vllm.store import PrefixStore


@dataclass(frozen=True)
class SchedulerFeatures:
    """The scheduler side's features (all off: an engine that only looks up the
    attention pages of one KV-cache group, and loads before the request runs).

    - ``saves``: the engine saves its finished prefills (a producer: ``kv_both`` or
      ``kv_producer``, and the store can serve it);
    - ``hybrid``: several KV-cache groups (``client.vllm.support.hybrid_groups``): block
      ids per group, pages gathered in the step their block becomes full;
    - ``layerwise``: a hit loads in the step that computes the rest of its prompt, layer
      by layer (``client.paging.layerwise``), not while the request waits;
    - ``states``: a state-space hybrid's groups (``client.vllm.states``), and
      ``state_store`` the lookups of its boundary states (None: a producer only): a hit
      ends at the last state stored within the attention prefix;
    - ``draft``: a speculative draft's pages (``client.vllm.drafts``): a hit is the
      shorter of the target's and the draft's prefixes, less ``draft_drop`` blocks
      (EAGLE/MTP).

    A hybrid, state-space or draft engine looks up even a P/D handoff's prefix (its
    hits need more than the attention pages an announcement names)."""

    saves: bool = False
    hybrid: bool = False
    layerwise: bool = False
    states: StateFacts | None = None
    state_store: PrefixStore | None = None
    draft: PrefixStore | None = None
    draft_drop: int = 0

    @property
    def claims_announcements(self) -> bool:
        """Whether a P/D decode's announced prefix is claimed without a lookup."""
        return not (self.hybrid or self.draft is not None or self.state_store is not None)
