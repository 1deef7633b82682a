"""Host buffers a client reuses across staged gets."""

from __future__ import annotations

import torch

# Staging buffers up to this size are kept for the next get (two at most).
STAGING_KEEP_BYTES = 256 << 20


class HostStaging:
    """Host buffers (pinned where CUDA is) for gets that land in host memory before the
    caller's tensor: a fresh 64 MiB buffer costs about 20 ms of page faults here, a
    third of a 2 MiB-page get (bench/transfer.py, head groups). Only the client's event
    loop thread calls it."""

    def __init__(self) -> None:
        self._kept: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``: a kept one if it is large enough."""
        for i, buf in enumerate(self._kept):
            if buf.numel() >= nbytes:
                return self._kept.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def give(self, buf: torch.Tensor) -> None:
        """Keep ``buf`` for the next get, unless it is large or two are kept already:
        at most 2 x STAGING_KEEP_BYTES stay allocated between calls. Never call it for
        a buffer a cancelled transfer may still be landing in."""
        if buf.numel() <= STAGING_KEEP_BYTES and len(self._kept) < 2:
            self._kept.append(buf)
