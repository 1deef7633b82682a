"""``kvstore up``: embedded Valkey and storage nodes on loopback, served until Ctrl-C.

The nodes are started through ``LocalCluster``, imported when the command runs so the
other commands start without it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
from typing import TYPE_CHECKING

from kvstore.errors import InvalidInputError
from kvstore.security.credentials import new_token
from kvstore.settings.events import local
from kvstore.tools.cli_access import index_from_env, write_secret
from kvstore.tools.cli_errors import EXIT_FAILED

if TYPE_CHECKING:
    from kvstore.tools.launcher import LocalCluster


def run_up(args: argparse.Namespace) -> int:
    """``kvstore up``: check the options, start the cluster and serve until Ctrl-C or
    until every node exited; returns the exit code."""
    from kvstore.index import PageIndex
    from kvstore.tools.launcher import LocalCluster

    if args.servers < 1:
        raise InvalidInputError(f"--servers must be at least 1, got {args.servers}")
    if args.index_shards < 1:
        raise InvalidInputError(f"--index-shards must be at least 1, got {args.index_shards}")
    if args.redis_url and args.index_shards > 1:
        raise InvalidInputError(
            "--index-shards starts an embedded index; it cannot be used with --redis-url"
        )
    password = index_from_env()[1] if args.redis_url else None
    if args.redis_url:
        PageIndex(args.redis_url, password=password).ping()  # fail now, not after 30 s
    with tempfile.TemporaryDirectory(prefix="kvstore-up-") as private:
        token_env, token_note = _data_plane_token(private)
        if args.disk_capacity and not args.disk_path:
            raise InvalidInputError(
                "--disk-capacity needs --disk-path (the directory the nodes' disk tiers live in)"
            )
        if args.disk_path and not args.disk_capacity:
            raise InvalidInputError(
                "--disk-path needs --disk-capacity (bytes each node's disk tier may take, e.g. 100GiB)"
            )
        events = args.kv_events_endpoint
        if events and not local(events):
            raise InvalidInputError(
                f"--kv-events-endpoint {events}: kvstore up serves on loopback, and its events "
                "would reach anyone on the network; give the loopback address a router binds "
                "(tcp://127.0.0.1:PORT, which every node connects to). A store whose routers "
                "read from other hosts runs kvstore server with --kv-events-routers-file "
                "(docs/security.md)"
            )
        extra = ["--disk-policy", args.disk_policy] if args.disk_path else []
        if events:
            # one token serves every tenant here, so whoever holds it reads them all:
            # the blocks keep their token ids, as on an --anonymous node
            extra += ["--kv-events-endpoint", events, "--kv-events-token-ids", "*"]
        # the nodes' logs outlive `kvstore up`: they are where a failed start or a
        # refused client is explained
        log_dir = (
            None if args.verbose else (args.log_dir or tempfile.mkdtemp(prefix="kvstore-up-logs-"))
        )
        cluster = LocalCluster(
            args.servers,
            args.capacity,
            redis_url=args.redis_url,
            redis_password=password,
            index_shards=args.index_shards,
            slab_size=args.slab_size,
            quiet=not args.verbose,
            env=token_env,
            disk_path=args.disk_path,
            disk_capacity=args.disk_capacity,
            extra_args=extra or None,
            log_dir=log_dir,
            progress=lambda line: print(f"kvstore up: {line}", flush=True),
        )
        return _serve(args, cluster, token_note)


def _data_plane_token(private_dir: str) -> tuple[dict[str, str], str]:
    """The nodes' token: the caller's (KVSTORE_AUTH_TOKEN or KVSTORE_AUTH_TOKEN_FILE in
    the environment), else a fresh random one in a file only this user can read. The
    token itself is never printed; clients are told where to read it."""
    if os.environ.get("KVSTORE_AUTH_TOKEN") or os.environ.get("KVSTORE_AUTH_TOKEN_FILE"):
        return {}, "data-plane token: the one in your KVSTORE_AUTH_TOKEN(_FILE)"
    path = os.path.join(private_dir, "auth-token")
    write_secret(path, new_token())
    return {"KVSTORE_AUTH_TOKEN_FILE": path}, f"export KVSTORE_AUTH_TOKEN_FILE={path}"


def _serve(args: argparse.Namespace, cluster: LocalCluster, token_note: str) -> int:
    from kvstore.index.urls import redact_url

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with cluster:
        index = f"a {args.index_shards}-shard Valkey cluster" if args.index_shards > 1 else "Valkey"
        disk = (
            f" over a disk tier of {args.disk_capacity} each in {args.disk_path}/<node id>"
            if args.disk_path
            else ""
        )
        print(
            f"kvstore up: {args.servers} storage node(s) of {args.capacity}{disk} and {index} on loopback"
        )
        # ready to paste into the shell of a client: KVCacheClient reads KVSTORE_* for
        # every option it is not given (a password stays out of the printed URL)
        print(f"export KVSTORE_REDIS_URL={redact_url(cluster.redis_url)}", flush=True)
        print(token_note, flush=True)
        for line in _node_lines(cluster):
            print(line, flush=True)
        print("press Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            if all(n.process.poll() is not None for n in cluster.nodes):
                reasons = "; ".join(
                    f"{n.node_id} (exit {n.process.returncode}): {n.exit_reason()}"
                    for n in cluster.nodes
                )
                print(f"kvstore up: all storage nodes exited: {reasons}", file=sys.stderr)
                return EXIT_FAILED
    print(
        "stopped"
        + (f"; node logs kept in {cluster.log_dir}" if cluster.log_dir is not None else "")
    )
    return 0


def _node_lines(cluster: LocalCluster) -> list[str]:
    """One line per storage node: its data-plane address, metrics port and log file,
    from the registry (what clients see)."""
    from kvstore.index import PageIndex

    index = PageIndex(cluster.redis_url, password=cluster.redis_password)
    try:
        registered = {n.node_id: n for n in index.live_nodes()}
    finally:
        index.close()
    lines = []
    for node in cluster.nodes:
        info = registered.get(node.node_id)
        metrics = info.extra.get("metrics", "none") if info else "?"
        log = f"log {node.log_path}" if node.log_path else "log here (--verbose)"
        lines.append(
            f"  {node.node_id}: data {info.address if info else 'not registered'}, "
            f"metrics http://{metrics}/metrics, {log}"
        )
    return lines
