"""Where a get's pages land in device memory: ``DeviceSpan`` (one page) and
``DeviceRows`` (a get's pages in one tensor, as arrays). Built by the connection and
the paged cache's callers, read by the copier (client/memory/device_pages.py), its
landings (device_landing.py) and copy plans (copy_plans.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

import numpy as np
import torch

if TYPE_CHECKING:
    from client.memory.layer_feed import LayerFeed


@dataclass(frozen=True, slots=True)
class DeviceSpan:
    """One page's place in device memory: ``nbytes`` bytes at ``offset`` of ``base``, a
    contiguous 1-D uint8 tensor on the copier's device (rows of one tensor share it)."""

    base: torch.Tensor
    offset: int
    nbytes: int
    # set for a get whose pages land layer by layer (``client.memory.layer_feed``)
    feed: LayerFeed | None = None

    def view(self) -> torch.Tensor:
        return self.base[self.offset : self.offset + self.nbytes]


class DeviceRows(Sequence[DeviceSpan]):
    """Pages of ``nbytes`` bytes in one device tensor, at ``offsets`` (bytes into
    ``base``, a flat uint8 tensor): a get's sinks as arrays (a ``DeviceSpan`` each only
    when one is asked for; a get names thousands)."""

    def __init__(
        self, base: torch.Tensor, offsets: np.ndarray, nbytes: int, feed: LayerFeed | None = None
    ) -> None:
        self.base = base
        self.offsets = offsets
        self.nbytes = nbytes
        self.feed = feed

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, k: int) -> DeviceSpan: ...

    @overload
    def __getitem__(self, k: slice) -> DeviceRows: ...

    def __getitem__(self, k: int | slice) -> DeviceSpan | DeviceRows:
        if isinstance(k, slice):
            return DeviceRows(self.base, self.offsets[k], self.nbytes, self.feed)
        return DeviceSpan(self.base, int(self.offsets[k]), self.nbytes, self.feed)

    def take(self, positions: Sequence[int] | np.ndarray) -> DeviceRows:
        """The pages at ``positions``, in that order."""
        return DeviceRows(
            self.base, self.offsets[np.asarray(positions, dtype=np.int64)], self.nbytes, self.feed
        )


def device_spans(
    rows: torch.Tensor, count: int, page_nbytes: int, feed: LayerFeed | None = None
) -> DeviceRows:
    """``count`` pages back to back at the start of ``rows`` (any contiguous tensor),
    landed layer by layer through ``feed`` when one is given."""
    flat = rows.reshape(-1).view(torch.uint8)
    if flat.numel() < count * page_nbytes:
        raise ValueError(f"{flat.numel()} bytes hold fewer than {count} pages of {page_nbytes}")
    return DeviceRows(flat, np.arange(count, dtype=np.int64) * page_nbytes, page_nbytes, feed)
