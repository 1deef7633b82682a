"""Which router a stream of kvstore's KV events is shaped for: ``--kv-events-profile``
on a storage node, ``kv_events_profile`` in the vLLM connector's extra config.

Both profiles are vLLM's wire format (kvstore.events.format); they differ in two
things routers read differently (docs/router-integration.md, "Profiles"):

- ``vllm`` (the default): block hashes as the publisher has them (a node's 16-byte
  page keys; vLLM's own hashes from the connector), and the store's blocks marked as
  such: ``ownership`` "kvstore", and ``locality`` "REMOTE" on the connector's events.
  vLLM's decoder, llm-d and any consumer that tells the store's blocks apart from an
  engine's own offloading tier read this.
- ``dynamo``: every block hash a 64-bit unsigned integer (the last 8 bytes of a byte
  hash, big-endian: what llm-d and later Dynamo sources make of byte hashes, and what
  vLLM's own int hashes are), and neither mark. NVIDIA Dynamo 1.6.1 refuses byte
  hashes (a batch with one fails to decode) and drops, without a word, an event whose
  ``ownership`` it does not know or whose ``locality`` is REMOTE
  (tests/dynamo/test_router_dynamo.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.events.format import OWNERSHIP, REMOTE, BlockHash
from kvstore.settings.events import EventProfileName as ProfileName

_U64 = (1 << 64) - 1


def u64_hash(h: BlockHash) -> int:
    """``h`` as a 64-bit unsigned integer: a byte hash's last 8 bytes, big-endian; an
    int's low 64 bits (vLLM's int hashes already are)."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h & _U64


@dataclass(frozen=True)
class EventProfile:
    """How a publisher shapes its events for the routers that read them."""

    name: ProfileName
    int_hashes: bool  # every block hash as u64_hash
    marked: bool  # ownership "kvstore" (and the connector's locality "REMOTE")

    def hashes(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """``hashes`` as this profile publishes them (the same list when unchanged)."""
        return [u64_hash(h) for h in hashes] if self.int_hashes else hashes

    @property
    def ownership(self) -> str | None:
        return OWNERSHIP if self.marked else None

    @property
    def remote(self) -> str | None:
        """The connector's ``locality``: the blocks are a storage node's, not the engine's."""
        return REMOTE if self.marked else None


PROFILES: dict[str, EventProfile] = {
    "vllm": EventProfile("vllm", int_hashes=False, marked=True),
    "dynamo": EventProfile("dynamo", int_hashes=True, marked=False),
}
