"""The ``kvstore`` command: ``server``, ``up``, ``demo``, ``stats``, ``credential``,
``events-key``, ``acl``, ``pd-proxy`` and the control commands ``pin``, ``unpin``,
``prefetch``, ``clear`` and ``where``.

This module parses the command line and runs one command: ``kvstore server`` execs
the storage node's program (``kvstore.tools.programs``: by module name, so this core
package never imports the storage node); ``up``
(``cli_up``) and ``demo`` start local processes through ``LocalCluster``; ``stats`` is
in ``cli_stats``, ``credential``, ``events-key`` and ``acl`` in ``cli_access``."""

from __future__ import annotations

import argparse
import os
import sys

from kvstore.errors import IndexUnavailableError, InvalidInputError, KVStoreError
from kvstore.tools.cli_access import run_acl, run_credential, run_events_key
from kvstore.tools.cli_control import CONTROL_COMMANDS, add_control_commands, run_control
from kvstore.tools.cli_errors import EXIT_FAILED, EXIT_INDEX, EXIT_USAGE
from kvstore.tools.cli_stats import run_stats
from kvstore.tools.cli_up import run_down, run_up
from kvstore.tools.programs import STORAGE_NODE


def main(argv: list[str] | None = None) -> int:
    """The ``kvstore`` console script (and ``python -m kvstore.tools.cli``): runs one
    command and returns its exit code; an error a user can cause is one line on stderr."""
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
        os.execv(sys.executable, STORAGE_NODE.argv(*argv[1:]))
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
        "--kv-events-endpoint",
        default=None,
        metavar="ADDRESS",
        help=(
            "every node publishes vLLM-format KV events to this ZMQ address, e.g. tcp://127.0.0.1:5557 "
            "where a router (or `kvstore`'s bench) binds a SUB socket; with one node a wildcard "
            "(tcp://*:5557) makes the node bind instead (docs/router-integration.md)"
        ),
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
    state_help = (
        "where kvstore up keeps its token, index port and pid across restarts "
        "(default $XDG_STATE_HOME/kvstore/up, or ~/.local/state/kvstore/up)"
    )
    up.add_argument("--state-dir", default=None, help=state_help)
    up.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help=(
            "restarts of a node that died, within 10 minutes, before it is given up on "
            "(default 5; 0: report a death, restart nothing)"
        ),
    )
    down = sub.add_parser("down", help="stop the kvstore up running on a state directory")
    down.add_argument("--state-dir", default=None, help=state_help)
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
    stats.add_argument(
        "--state-dir",
        default=None,
        help=(
            "a kvstore up's state directory: its nodes' deaths and restarts are shown "
            "when it serves this index (default: kvstore up's)"
        ),
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
    keys = sub.add_parser(
        "events-key",
        help="make a CURVE key pair for the KV event stream: a node's, or a router's and its routers-file line",
        description=(
            "Writes <name>.key and <name>.key_secret (mode 0600) into --out. For a node, "
            "prints its public key (routers pin it); for a router, prints the line of the "
            "nodes' --kv-events-routers-file that lets it read --tenant's events. See "
            "docs/security.md."
        ),
    )
    keys.add_argument("role", choices=["node", "router"], help="whose key pair")
    keys.add_argument("--name", default=None, help="the router's name (a node's: node)")
    keys.add_argument(
        "--tenant",
        action="append",
        default=[],
        help="a tenant whose events the router reads (repeat for several; * for every tenant)",
    )
    keys.add_argument("--out", required=True, help="directory to write the key files to")
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
    proxy = sub.add_parser(
        "pd-proxy",
        help="an OpenAI-compatible front for disaggregated prefill and decode servers (vLLM)",
        description=(
            "Sends each completion to a prefill server (kv_transfer_params do_remote_decode,"
            " one token), then to a decode server with the prefill's kv_transfer_params."
            " See docs/vllm-connector.md, 'Disaggregated prefill/decode'."
        ),
    )
    proxy.add_argument("--prefill", required=True, help="prefill servers' URLs, comma-separated")
    proxy.add_argument("--decode", required=True, help="decode servers' URLs, comma-separated")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on")
    proxy.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one upstream request may take"
    )
    add_control_commands(sub)
    args = parser.parse_args(argv)
    if args.command in CONTROL_COMMANDS:
        return run_control(args)
    if args.command == "pd-proxy":
        from kvstore.tools.pd_proxy import run_pd_proxy

        return run_pd_proxy(args.prefill, args.decode, args.host, args.port, args.timeout)
    if args.command == "acl":
        return run_acl(args)
    if args.command == "credential":
        return run_credential(args)
    if args.command == "events-key":
        return run_events_key(args)
    if args.command == "up":
        return run_up(args)
    if args.command == "down":
        return run_down(args)
    if args.command == "demo":
        from kvstore.tools.demo import run_demo

        if not 0 < args.shared < args.tokens:
            parser.error("--shared must lie between 0 and --tokens")
        return run_demo(args.servers, args.tokens, args.shared, disk=args.disk)
    return run_stats(args)


if __name__ == "__main__":
    sys.exit(main())
