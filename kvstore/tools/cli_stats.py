"""``kvstore stats``: the nodes and namespaces an index holds, as lines or JSON; and,
when a ``kvstore up`` serves that index from the state directory, which of its nodes
died and were restarted (``kvstore.tools.supervise``)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from kvstore.settings.sizes import format_size
from kvstore.tools.cli_access import index_from_env
from kvstore.tools.supervise import summary_lines
from kvstore.tools.up_state import UpState

if TYPE_CHECKING:
    from kvstore.pages.namespace import Namespace


def run_stats(args: argparse.Namespace) -> int:
    """``kvstore stats``: the index's live nodes and namespaces, as text or one JSON
    document; returns the exit code."""
    from kvstore.index import PageIndex

    url, password = index_from_env()
    index = PageIndex(args.redis_url or url, password=password)
    stats = index.stats()
    up = _up_supervision(args.redis_url or url or "", getattr(args, "state_dir", None))
    if args.json:
        nodes = [
            {
                "node_id": n.node_id,
                "address": n.address,
                "capacity": n.capacity,
                "incarnation": n.incarnation,
                **{k: int(n.extra[k]) for k in _NODE_FIGURES if n.extra.get(k, "").isdigit()},
            }
            for n in stats.nodes
        ]
        spaces = [
            {
                "digest": s.digest,
                "pages": s.pages,
                "per_node": s.per_node,
                "namespace": s.namespace.model_dump() if s.namespace else None,
            }
            for s in stats.namespaces
        ]
        doc = {"shards": index.shards, "nodes": nodes, "namespaces": spaces, "up": up}
        print(json.dumps(doc, indent=2))
        return 0
    if index.cluster:
        print(f"index: a cluster of {index.shards} shard(s)")
    print(f"{len(stats.nodes)} live node(s)")
    for n in stats.nodes:
        used = (
            f"used {format_size(int(n.extra['used']))} of {format_size(n.capacity)}"
            if n.extra.get("used", "").isdigit()
            else f"capacity {format_size(n.capacity)}"
        )
        hits, misses = n.extra.get("hits", ""), n.extra.get("misses", "")
        reads = (
            f", {hits} pages read, {misses} asked but not held"
            if hits.isdigit() and misses.isdigit()
            else ""
        )
        print(
            f"  {n.node_id:20} {n.address:24} {used}{_disk_line(n.extra)}{reads}, incarnation {n.incarnation}"
        )
    print(f"{len(stats.namespaces)} namespace(s)")
    for s in stats.namespaces:
        name = _namespace_line(s.namespace) if s.namespace else "?"
        print(f"  {s.digest} {s.pages:>8} pages  {name}")
    if up is not None:
        for line in summary_lines(up) or ["no storage node died"]:
            print(f"kvstore up (pid {up['pid']}): {line}")
    return 0


def _up_supervision(url: str, state_dir: str | None) -> dict | None:
    """The supervision document of the ``kvstore up`` running on ``state_dir`` when it
    serves the index at ``url`` (the URL it printed); None otherwise."""
    from kvstore.index.urls import redact_url

    doc = UpState(state_dir).supervision()
    return doc if doc is not None and doc.get("index_url") == redact_url(url) else None


def _namespace_line(ns: Namespace) -> str:
    """What tells two namespaces apart, on one line of `kvstore stats`: engines share
    pages only when all of it agrees (docs/key-format.md)."""
    weights = f" weights {ns.weights[:24]}" if ns.weights else ""
    return (
        f"{ns.model} {ns.dtype} {ns.layout} layers {ns.num_layers} "
        f"heads {ns.num_kv_heads}x{ns.head_size} block {ns.block_size} "
        f"head groups {ns.groups} pp {ns.pp_rank} tenant {ns.tenant}{weights}"
    )


# What `kvstore stats --json` reports of each node, from its registry entry.
_NODE_FIGURES = (
    "used",
    "hits",
    "misses",
    "memory_pages",
    "disk_used",
    "disk_capacity",
    "disk_pages",
    "disk_hits",
    "disk_degraded",
)


def _disk_line(extra: dict[str, str]) -> str:
    """A node's disk tier in `kvstore stats`, or '' when it has none."""
    if not extra.get("disk_capacity", "").isdigit():
        return ""
    degraded = " (DEGRADED: see its /healthz)" if extra.get("disk_degraded") == "1" else ""
    return (
        f" ({extra.get('memory_pages', '?')} pages in memory), "
        f"disk {format_size(int(extra['disk_used']))} of {format_size(int(extra['disk_capacity']))}"
        f" ({extra.get('disk_pages', '?')} pages, {extra.get('disk_hits', '?')} read from disk){degraded}"
    )
