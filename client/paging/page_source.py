"""``PageSource``: what the load path (``client.paging.loader.PageLoader``) asks of the
store it loads from. Engine-neutral: it names no engine and no transport.

``KVCacheClient`` satisfies it unchanged; so does the in-memory store of the fast tests
(``tests/support/memory_store.py``), which lands real page bytes where a plan says. The
vLLM connector's worker takes its stores as ``client.vllm.store.PageStore``, this plus
its lookups, puts and pins."""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from client.gets.plan import GetPlan
from kvstore.pages.heads import RankUnits
from kvstore.pages.namespace import Namespace

R = TypeVar("R")


class PageSource(Protocol):
    """One namespace's pages, fetched by plan (``client.gets.plan``), from any thread."""

    @property
    def namespace(self) -> Namespace:
        """The namespace whose pages it holds (a worker's: its rank's share)."""
        ...

    @property
    def heads(self) -> RankUnits:
        """The head-group units this rank reads (``kvstore.pages.heads``)."""
        ...

    def units_nbytes(self, blocks: int) -> int:
        """Bytes of this rank's units of ``blocks`` blocks (an ``IntoUnits`` buffer)."""
        ...

    def lands_on_device(self, memory: torch.device) -> bool:
        """Whether an ``IntoDevice`` plan can land in ``memory``."""
        ...

    def lands_layers(self, memory: torch.device) -> bool:
        """Whether an ``IntoLayers`` plan (layer by layer, with a feed) can land there."""
        ...

    def read(self, plan: GetPlan[R]) -> R:
        """Run ``plan``: its pages verified where they land, the prefix ending at the
        first block that did not arrive; a fault or the deadline gives the
        destination's ``miss``. Never raises for a missing page."""
        ...
