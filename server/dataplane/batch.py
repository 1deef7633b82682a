"""One PUT request's state as it moves through plan, receive and commit."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvstore.wire import protocol as P
from server.page import StoredPage


@dataclass
class PutBatch:
    """One PUT request as it moves through plan, receive and commit.

    ``pages`` are the slots this request claimed (parallel to ``wanted``); ``good``
    are those received and verified; whatever is not in ``committed`` when the
    request ends is released. ``runs``, ``plan_sent`` and ``landing`` are the UCX
    path's: the pages grouped into messages, the plan's sends, and per run its first
    and past-last page with the future of its landing."""

    req: P.PutRequest
    present: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    wanted: list[int] = field(default_factory=list)
    pages: list[StoredPage] = field(default_factory=list)
    runs: list[int] = field(default_factory=list)
    good: list[StoredPage] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    committed: set[StoredPage] = field(default_factory=set)
    plan_sent: list[asyncio.Future[Any]] = field(default_factory=list)
    landing: list[tuple[int, int, asyncio.Future[Any]]] = field(default_factory=list)

    @property
    def stored(self) -> list[int]:
        return [i for i, p in zip(self.wanted, self.pages) if p in self.committed]

    def plan_fields(self) -> dict[str, Any]:
        """The ``PutPlan`` fields both paths send (the same-host path adds where the slots lie)."""
        return dict(
            wanted=self.wanted, runs=self.runs, present=self.present, refused=sorted(self.refused)
        )
