"""Where fetched pages land on their way into a caller's memory: the one choice that
both the client's gets (``client.reads``) and the vLLM worker's loads
(``client.vllm.worker``) make, so that the two cannot drift apart.

- ``IN_PLACE``: every page is received straight into the destination's own bytes (a
  span per block over them) and checked there against its checksum.
- ``STAGED``: pages are received into host memory of the pool, checked there, then
  copied into the destination in one pass (device memory, a destination whose bytes
  cannot be viewed, or ``transfer_mode='staged'``).
- ``UNITS``: a page of this rank is not one stored unit (it spans several head or
  layer groups, or part of one: ``kvstore.pages.heads``): the units are received into
  a buffer and the rank's heads are taken out of them."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Literal, TypeVar

from kvstore.errors import InvalidInputError
from kvstore.pages.heads import RankUnits

TransferMode = Literal["auto", "direct", "staged"]
Spans = TypeVar("Spans")


class Landing(Enum):
    IN_PLACE = "in_place"
    STAGED = "staged"
    UNITS = "units"


def choose_landing(
    heads: RankUnits, in_place: Callable[[], Spans | None]
) -> tuple[Landing, Spans | None]:
    """How pages of a get land (see the module docstring), and with ``IN_PLACE`` the
    destination's spans to land in. ``in_place`` gives the destination's own spans, or
    None where it cannot take pages in place; it is asked only when whole pages land
    (building spans costs: 0.43 ms for 96 blocks of a 10-layer cache)."""
    if not heads.identity:
        return Landing.UNITS, None
    spans = in_place()
    return (Landing.STAGED, None) if spans is None else (Landing.IN_PLACE, spans)


def lands_in_place(device_type: str, transfer_mode: TransferMode) -> bool:
    """Whether a client's get may receive pages straight into a tensor on
    ``device_type``: host memory unless the caller asked for staging. Raises
    ``InvalidInputError`` for ``transfer_mode='direct'`` into any other memory."""
    if device_type == "cpu":
        return transfer_mode != "staged"
    # Device memory is reached through pinned host staging: every page is checked
    # against its checksum as it lands, and the check reads host memory. A receive
    # straight into device memory (UCX's cuda_copy) raised in that check, so each
    # such get counted a healthy node as failed and missed; 'auto' picked it on every
    # CUDA-capable UCX build without the same-host path (found reading the GPU
    # check's code paths, bench/gpu_check.py; no GPU was lent to measure it).
    if transfer_mode == "direct":
        raise InvalidInputError(
            f"transfer_mode='direct' into {device_type} memory is not offered: a page received there cannot be "
            "checked against its checksum; use 'auto' or 'staged' (pinned host memory, checked, "
            "then one copy to the device)"
        )
    return False
