"""Who a storage node is in the index (``NodeIdentity``), shared by the parts that
write to the index: the registry (server/registry.py), puts, and the retirer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class NodeIdentity:
    """Who this node is in the index. ``incarnation`` is set when it registers;
    ``index_stale`` says the index may advertise pages this node no longer holds."""

    node_id: str
    incarnation: str = ""
    number: int = 0  # the node id's number in the registry; index entries name it
    index_stale: bool = False
