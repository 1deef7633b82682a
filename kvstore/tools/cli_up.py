"""``kvstore up``: embedded Valkey and storage nodes on loopback, served until Ctrl-C or
``kvstore down``; a restart on the same state directory (``kvstore.tools.up_state``)
keeps the index URL and the token, so engines recover by themselves. While it serves,
a node that dies is reported and restarted (``kvstore.tools.supervise``).

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
from kvstore.settings.events import local
from kvstore.tools.cli_access import index_from_env
from kvstore.tools.cli_errors import EXIT_FAILED
from kvstore.tools.supervise import (
    RestartPolicy,
    Supervisor,
    check_memory,
    memory_available,
    summary_lines,
)
from kvstore.tools.up_state import UpState

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
    if args.max_restarts < 0:
        raise InvalidInputError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    # before anything starts: a store that cannot fit would be half started, or OOM-killed
    warning = check_memory(args.servers, args.capacity, memory_available())
    if warning:
        print(f"kvstore up: {warning}", file=sys.stderr, flush=True)
    password = index_from_env()[1] if args.redis_url else None
    if args.redis_url:
        PageIndex(args.redis_url, password=password).ping()  # fail now, not after 30 s
    state = UpState(args.state_dir)
    state.claim()
    try:
        token_env, token_note = _data_plane_token(state)
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
            # the same index URL as the last start on this state directory, when free
            index_port=None if args.redis_url or args.index_shards > 1 else state.index_port(),
        )
        return _serve(args, cluster, token_note, state)
    finally:
        state.release()


def _data_plane_token(state: UpState) -> tuple[dict[str, str], str]:
    """The nodes' token: the caller's (KVSTORE_AUTH_TOKEN or KVSTORE_AUTH_TOKEN_FILE in
    the environment), else the state directory's, made the first time in a file only
    this user can read and kept across restarts. The token itself is never printed;
    clients are told where to read it."""
    if os.environ.get("KVSTORE_AUTH_TOKEN") or os.environ.get("KVSTORE_AUTH_TOKEN_FILE"):
        return {}, "data-plane token: the one in your KVSTORE_AUTH_TOKEN(_FILE)"
    path = state.token_file()
    return {"KVSTORE_AUTH_TOKEN_FILE": path}, f"export KVSTORE_AUTH_TOKEN_FILE={path}"


def run_down(args: argparse.Namespace) -> int:
    """``kvstore down``: stop the ``kvstore up`` running on the state directory (SIGTERM,
    then wait for it); stopping none is not an error."""
    state = UpState(args.state_dir)
    try:
        pid = state.stop()
    except TimeoutError as exc:
        print(f"kvstore down: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if pid is None:
        print(f"kvstore down: no kvstore up runs with state directory {state.path}")
    else:
        print(f"kvstore down: stopped kvstore up (pid {pid}, state directory {state.path})")
        doc = state.supervision(pid)
        if doc is not None:
            for line in summary_lines(doc) or ["no storage node died"]:
                print(f"kvstore down: while it ran, {line}")
    return 0


def _serve(args: argparse.Namespace, cluster: LocalCluster, token_note: str, state: UpState) -> int:
    from kvstore.index.urls import redact_url
    from kvstore.tools.valkey import EmbeddedValkey

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with cluster:
        if isinstance(cluster.valkey, EmbeddedValkey):  # one shard: its URL is its port
            state.keep_index_port(cluster.valkey.port)
        index = (
            f"the index at {redact_url(args.redis_url)}"
            if args.redis_url
            else f"a {args.index_shards}-shard Valkey cluster on loopback"
            if args.index_shards > 1
            else "Valkey on loopback"
        )
        disk = (
            f" over a disk tier of {args.disk_capacity} each in {args.disk_path}/<node id>"
            if args.disk_path
            else ""
        )
        print(f"kvstore up: {args.servers} storage node(s) of {args.capacity}{disk} and {index}")
        # ready to paste into the shell of a client: KVCacheClient reads KVSTORE_* for
        # every option it is not given (a password stays out of the printed URL)
        print(f"export KVSTORE_REDIS_URL={redact_url(cluster.redis_url)}", flush=True)
        print(token_note, flush=True)
        for line in _node_lines(cluster):
            print(line, flush=True)
        supervisor = Supervisor(
            cluster,
            policy=RestartPolicy(max_restarts=args.max_restarts),
            report=lambda line: print(f"kvstore up: {line}", flush=True),
            persist=state.write_supervision,
            stopping=stop.is_set,
            index_url=redact_url(cluster.redis_url),
        )
        print(
            f"press Ctrl-C to stop, or run `kvstore down` (state directory {state.path}: a "
            "restart there keeps the index URL and the token)",
            flush=True,
        )
        try:
            # every half second: a dead node is reported within that
            while not stop.wait(0.5):
                if not supervisor.poll():  # every node given up on
                    reasons = "; ".join(
                        f"{node_id}: {rec.last_cause}"
                        for node_id, rec in supervisor.records.items()
                    )
                    print(f"kvstore up: all storage nodes exited: {reasons}", file=sys.stderr)
                    return EXIT_FAILED
        finally:
            supervisor.close()
        died = summary_lines(supervisor.document())
    for line in died:
        print(f"kvstore up: while it ran, {line}")
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
