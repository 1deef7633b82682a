"""The ``kvstore`` command: ``server``, ``up``, ``demo``, ``stats``, ``credential`` and ``acl``.

``kvstore server`` execs ``python -m server`` so this core package never imports the
storage node; ``up`` and ``demo`` start local processes through ``LocalCluster``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from typing import Any

from kvstore.errors import IndexUnavailableError, InvalidInputError, KVStoreError
from kvstore.security.credentials import make_credential, new_token, token_digest
from kvstore.settings.sizes import format_size
from kvstore.tools.cli_errors import EXIT_FAILED, EXIT_INDEX, EXIT_USAGE


def _up(args: argparse.Namespace) -> int:
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
    password = _index_from_env()[1] if args.redis_url else None
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
            extra_args=["--disk-policy", args.disk_policy] if args.disk_path else None,
            log_dir=log_dir,
            progress=lambda line: print(f"kvstore up: {line}", flush=True),
        )
        return _serve(args, cluster, token_note)


def _index_from_env() -> tuple[str, str | None]:
    """The index URL and password from KVSTORE_REDIS_URL and KVSTORE_REDIS_PASSWORD(_FILE),
    read and checked once, as a client reads them."""
    from kvstore.settings.config import client_options_from_env

    options = client_options_from_env()
    return options.redis_url, options.redis_password.get_secret_value() or None


def _data_plane_token(private_dir: str) -> tuple[dict[str, str], str]:
    """The nodes' token: the caller's (KVSTORE_AUTH_TOKEN or KVSTORE_AUTH_TOKEN_FILE in
    the environment), else a fresh random one in a file only this user can read. The
    token itself is never printed; clients are told where to read it."""
    if os.environ.get("KVSTORE_AUTH_TOKEN") or os.environ.get("KVSTORE_AUTH_TOKEN_FILE"):
        return {}, "data-plane token: the one in your KVSTORE_AUTH_TOKEN(_FILE)"
    path = os.path.join(private_dir, "auth-token")
    _write_secret(path, new_token())
    return {"KVSTORE_AUTH_TOKEN_FILE": path}, f"export KVSTORE_AUTH_TOKEN_FILE={path}"


def _serve(args: argparse.Namespace, cluster: Any, token_note: str) -> int:
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


def _node_lines(cluster: Any) -> list[str]:
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


def _stats(args: argparse.Namespace) -> int:
    from kvstore.index import PageIndex

    url, password = _index_from_env()
    index = PageIndex(args.redis_url or url, password=password)
    stats = index.stats()
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
        print(json.dumps({"shards": index.shards, "nodes": nodes, "namespaces": spaces}, indent=2))
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
    return 0


def _namespace_line(ns: Any) -> str:
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


def _write_secret(path: str, text: str) -> None:
    """Create ``path`` readable by this user only (never over an existing file) holding ``text``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _credential(args: argparse.Namespace) -> int:
    """Write a new token to ``--token-file`` (mode 0600, never overwritten) and print the
    line that grants it, for the nodes' credentials file. The token is never printed."""
    credential = make_credential(args.name, args.rights, args.tenant)
    token = new_token()
    try:
        _write_secret(args.token_file, token + "\n")
    except OSError as exc:
        raise InvalidInputError(
            f"cannot create --token-file {args.token_file}: {exc.strerror}"
        ) from None
    print(credential.line(token_digest(token)))
    print(
        f"token written to {args.token_file}: clients read it with KVSTORE_AUTH_TOKEN_FILE={args.token_file}",
        file=sys.stderr,
    )
    return 0


def _acl(args: argparse.Namespace) -> int:
    """Print the index ACL rules of a role, or with --user a whole aclfile line (the
    password as its SHA-256, read from --password-file)."""
    from kvstore.security import acl

    if not args.user:
        print(acl.rules(args.role, args.tenant))
        return 0
    if not args.password_file:
        raise InvalidInputError(
            "--user needs --password-file (the aclfile line holds the password's SHA-256)"
        )
    try:
        with open(args.password_file) as f:
            password = f.read().rstrip("\r\n")
    except OSError as exc:
        raise InvalidInputError(
            f"cannot read --password-file {args.password_file}: {exc.strerror}"
        ) from None
    print(acl.aclfile_line(args.user, args.role, args.tenant, password))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except InvalidInputError as exc:
        return _fail(argv, exc, EXIT_USAGE)
    except IndexUnavailableError as exc:
        return _fail(argv, exc, EXIT_INDEX)
    except KVStoreError as exc:
        return _fail(argv, exc, EXIT_FAILED)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstore")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _fail(argv: list[str], exc: Exception, code: int) -> int:
    name = f"kvstore {argv[0]}" if argv and not argv[0].startswith("-") else "kvstore"
    print(f"{name}: {exc}", file=sys.stderr)
    return code


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "server":
        os.execv(sys.executable, [sys.executable, "-m", "server", *argv[1:]])
    parser = argparse.ArgumentParser(
        prog="kvstore", description="Storage-tier KV cache for LLM inference"
    )
    parser.add_argument("--version", action="version", version=f"kvstore {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("server", help="run a storage node (see kvstore server --help)")
    up = sub.add_parser("up", help="run embedded Valkey and storage nodes on loopback until Ctrl-C")
    up.add_argument("--servers", type=int, default=1, help="storage nodes to start (default 1)")
    up.add_argument(
        "--capacity", default="1GiB", help="page memory per storage node, e.g. 4GiB (default 1GiB)"
    )
    up.add_argument(
        "--slab-size",
        default="64MiB",
        help="allocator slab size, also the largest page (default 64MiB)",
    )
    up.add_argument(
        "--redis-url", default=None, help="use this Redis/Valkey instead of starting one"
    )
    up.add_argument(
        "--index-shards",
        type=int,
        default=1,
        help="start the embedded index as a Valkey cluster of this many shards (prints a redis+cluster:// URL)",
    )
    up.add_argument(
        "--disk-path",
        default=None,
        help=(
            "give every node a disk tier in DIR/<node id> (docs/storage-tiers.md); "
            "a restart on the same DIR keeps the pages"
        ),
    )
    up.add_argument(
        "--disk-capacity",
        default=None,
        help="bytes each node's disk tier may take, e.g. 100GiB (with --disk-path)",
    )
    up.add_argument(
        "--disk-policy",
        default="write-back",
        choices=["write-back", "write-through"],
        help="how pages reach disk (default write-back)",
    )
    up.add_argument(
        "--verbose",
        action="store_true",
        help="show the storage nodes' logs here instead of log files",
    )
    up.add_argument(
        "--log-dir",
        default=None,
        help="write each node's log to DIR/<node id>.log (default: a new directory, kept after exit)",
    )
    demo = sub.add_parser(
        "demo", help="prefill and decode processes sharing KV through a local store"
    )
    demo.add_argument("--servers", type=int, default=2, help="storage nodes (default 2)")
    demo.add_argument("--tokens", type=int, default=2030, help="prompt length")
    demo.add_argument("--shared", type=int, default=1000, help="tokens the second session shares")
    demo.add_argument(
        "--disk",
        action="store_true",
        help=(
            "nodes with a small memory pool over a disk tier: "
            "prompt A served from disk after eviction and after a restart"
        ),
    )
    stats = sub.add_parser("stats", help="print nodes and namespaces in an index")
    stats.add_argument(
        "--redis-url",
        default=None,
        help="the index: redis://, rediss://, unix:// or redis+cluster://host:port,... (default $KVSTORE_REDIS_URL)",
    )
    stats.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (nodes with used bytes and read counters, namespaces)",
    )
    cred = sub.add_parser(
        "credential",
        help="make a data-plane token for tenants and print its credentials-file line",
        description=(
            "Writes a new random token to --token-file and prints the line a node's "
            "--credentials-file needs to accept it (the token's SHA-256, never the token)."
        ),
    )
    cred.add_argument(
        "--name",
        required=True,
        help="who holds it, e.g. engine-team-a (shown in refusals and logs)",
    )
    cred.add_argument(
        "--tenant",
        action="append",
        required=True,
        help="a tenant it may use (repeat for several; * for every tenant)",
    )
    cred.add_argument(
        "--rights",
        choices=["read", "readwrite"],
        default="readwrite",
        help="read: get pages only; readwrite: also put (default)",
    )
    cred.add_argument(
        "--token-file", required=True, help="new file to write the token to (mode 0600)"
    )
    acl = sub.add_parser(
        "acl",
        help="print the Redis/Valkey ACL rules of an index role (node, client of a tenant, operator)",
        description=(
            "Prints the rules for ACL SETUSER <user> on >PASSWORD <rules>, "
            "or with --user an aclfile line. See docs/security.md."
        ),
    )
    acl.add_argument(
        "--role",
        required=True,
        choices=["node", "client", "operator"],
        help="node: storage nodes; client: engines of one tenant; operator: read-only",
    )
    acl.add_argument("--tenant", default=None, help="the tenant of a client role")
    acl.add_argument("--user", default=None, help="print a whole aclfile line for this user")
    acl.add_argument(
        "--password-file", default=None, help="file holding the user's password (with --user)"
    )
    args = parser.parse_args(argv)
    if args.command == "acl":
        return _acl(args)
    if args.command == "credential":
        return _credential(args)
    if args.command == "up":
        return _up(args)
    if args.command == "demo":
        from kvstore.tools.demo import run_demo

        if not 0 < args.shared < args.tokens:
            parser.error("--shared must lie between 0 and --tokens")
        return run_demo(args.servers, args.tokens, args.shared, disk=args.disk)
    return _stats(args)


if __name__ == "__main__":
    sys.exit(main())
