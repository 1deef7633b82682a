"""Where fetched pages land on their way into a caller's memory: the one choice that
both the client's gets (``client.gets.reads``) and the vLLM worker's loads
(``client.vllm.worker``) make, so that the two cannot drift apart.

- ``IN_PLACE``: every page is received straight into the destination's own bytes (a
  span per block over them) and checked there against its checksum.
- ``STAGED``: pages are received into host memory of the pool, checked there, then
  copied into the destination in one pass (device memory, a destination whose bytes
  cannot be viewed, or ``transfer_mode='staged'``).
- ``DEVICE``: every page is copied straight into device memory (from a node's
  registered memory on the same host, from pinned host memory over UCX) and checked
  there against its checksum (``client.memory.device_pages``).
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
    DEVICE = "device"
    UNITS = "units"


def choose_landing(
    heads: RankUnits, in_place: Callable[[], Spans | None], on_device: bool = False
) -> tuple[Landing, Spans | None]:
    """How pages of a get land (see the module docstring), and with ``IN_PLACE`` the
    destination's spans to land in. ``on_device``: the destination is memory the
    client's device copier reaches (``AsyncKVCacheClient.lands_on_device``, which also
    requires whole pages). ``in_place`` gives the destination's own spans, or None where
    it cannot take pages in place; it is asked only when whole host pages land
    (building spans costs: 0.43 ms for 96 blocks of a 10-layer cache)."""
    if not heads.identity:
        return Landing.UNITS, None
    if on_device:
        return Landing.DEVICE, None
    spans = in_place()
    return (Landing.STAGED, None) if spans is None else (Landing.IN_PLACE, spans)


def lands_in_place(device_type: str, transfer_mode: TransferMode) -> bool:
    """Whether a client's get may receive pages straight into a tensor on
    ``device_type``: host memory unless the caller asked for staging. Raises
    ``InvalidInputError`` for ``transfer_mode='direct'`` into any other memory."""
    if device_type == "cpu":
        return transfer_mode != "staged"
    # Device memory that the client's copier reaches takes Landing.DEVICE before this
    # is asked. Anything else is reached through pinned host staging: every page is
    # checked against its checksum as it lands, and the check reads host memory (a UCX
    # receive straight into device memory raised in that check: each such get counted a
    # healthy node as failed and missed).
    if transfer_mode == "direct":
        raise InvalidInputError(
            f"transfer_mode='direct' into {device_type} memory needs a device copier that checks "
            "pages there (CUDA with Triton: client.memory.device_pages); use 'auto' or 'staged' "
            "(pinned host memory, checked, then one copy to the device)"
        )
    return False
