"""``kvstore pin|unpin|prefetch|clear|where``: the operator control API from a shell
(docs/operations.md, "Steering the cache").

A prefix is named as the API names it (``kvstore.control.requests``): ``--model`` with
``--tokens`` (the nodes hash them for every namespace of the model, under ``--lora``,
``--salt`` and ``--block-size``), or ``--block-hashes`` with ``--namespace`` (a digest)
or ``--model``. ``clear`` also takes no prefix (a namespace, a model, or with neither
the whole tenant) and then wants ``--tenant`` given outright, as a guard. The index
comes from ``--redis-url`` or KVSTORE_REDIS_URL (as ``kvstore stats`` reads it), the
bearer token from KVSTORE_AUTH_TOKEN / KVSTORE_AUTH_TOKEN_FILE (as a client reads it);
``kvstore.control.caller`` asks every live node and adds up. Prints a line per node and
a total (``where``: a table per namespace), or one JSON document with ``--json``; exits
1 when a node could not be reached (the action is incomplete there)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from pydantic import ValidationError

from kvstore.control.reports import ControlReport, WhereReport
from kvstore.control.requests import ClearRequest, PinRequest, PrefixRequest, Scope
from kvstore.errors import InvalidInputError, first_problem
from kvstore.settings.sizes import format_size
from kvstore.tools.cli_errors import EXIT_FAILED, EXIT_OK

CONTROL_COMMANDS = ("pin", "unpin", "prefetch", "clear", "where")
_HELP = {
    "pin": "keep a prefix's pages in memory on every node that holds them",
    "unpin": "release a prefix's pins on every node",
    "prefetch": "bring a prefix's pages on disk back into memory on every node",
    "clear": "drop a prefix's, a namespace's, a model's or a tenant's pages from every node",
    "where": "show which nodes hold a prefix's blocks, in memory or on disk, pinned or not",
}
_DONE = {
    "pin": "pinned",
    "unpin": "unpinned",
    "prefetch": "prefetched",
    "clear": "cleared",
}
_DESCRIPTION = (
    "Asks every live storage node (a node acts on the pages it holds) and adds up. "
    "Name a prefix by --model and --tokens, or by --block-hashes with --namespace or "
    "--model; clear also takes a namespace, a model or (neither) the whole --tenant. "
    "The token: KVSTORE_AUTH_TOKEN or KVSTORE_AUTH_TOKEN_FILE. Exits 1 when a node "
    "could not be reached. See docs/operations.md, 'Steering the cache'."
)
# a body field -> the option that sets it, for one-line errors
_OPTIONS = {
    "token_ids": "--tokens",
    "block_hashes": "--block-hashes",
    "lora_name": "--lora",
    "cache_salt": "--salt",
    "block_size": "--block-size",
    "ttl_s": "--ttl",
}


def add_control_commands(sub: Any) -> None:
    """Register the five commands on ``kvstore``'s subparsers (``kvstore.tools.cli``)."""
    for name in CONTROL_COMMANDS:
        p = sub.add_parser(name, help=_HELP[name], description=_DESCRIPTION)
        p.add_argument("--model", default=None, help="the model whose namespaces to act on")
        p.add_argument(
            "--tokens",
            default=None,
            help="token ids, comma or space separated, or @FILE holding a JSON list (with --model)",
        )
        p.add_argument(
            "--block-hashes",
            default=None,
            help="the store's block hashes, comma-separated hex, in prefix order",
        )
        p.add_argument("--namespace", default=None, help="a namespace digest (32 hex digits)")
        p.add_argument("--lora", default=None, help="the adapter the KV was made with")
        p.add_argument("--salt", default=None, help="the request's cache salt")
        p.add_argument("--block-size", type=int, default=None, help="only namespaces of this")
        p.add_argument(
            "--tenant",
            default=None,
            help="whose pages (default 'default'; clear wants it given, as a guard)",
        )
        if name == "pin":
            p.add_argument(
                "--ttl",
                type=float,
                default=None,
                help="seconds the pin lasts (default: until unpin)",
            )
        p.add_argument("--redis-url", default=None, help="the index (default $KVSTORE_REDIS_URL)")
        p.add_argument("--json", action="store_true", help="print one JSON document")


def run_control(args: argparse.Namespace) -> int:
    """Run one control command; returns its exit code (errors a user can cause raise
    ``InvalidInputError``, turned into one line by ``kvstore.tools.cli``)."""
    from kvstore.control.caller import ControlCaller
    from kvstore.index import PageIndex
    from kvstore.settings.client import client_options_from_env
    from kvstore.tools.cli_access import index_from_env

    body = control_body(args)
    url, password = index_from_env()
    token = client_options_from_env().auth_token.get_secret_value()
    index = PageIndex(args.redis_url or url, password=password)
    try:
        caller = ControlCaller(index.live_nodes, token)
        if args.command == "where":
            assert isinstance(body, PrefixRequest)
            where = caller.where(body)
            unreachable, asked = where.unreachable, len(where.residency) + len(where.unreachable)
            lines = where_lines(where)
            doc: dict[str, Any] = where_doc(where)
        else:
            report = caller.call(f"/v1/kv/{args.command}", body)
            unreachable, asked = report.unreachable, len(report.nodes) + len(report.unreachable)
            lines = report_lines(report)
            doc = {**dataclasses.asdict(report), "nodes": [n.model_dump() for n in report.nodes]}
    finally:
        index.close()
    if not asked:
        print(f"kvstore {args.command}: no live storage node in the index", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(doc, indent=2) if args.json else "\n".join(lines))
    return EXIT_FAILED if unreachable else EXIT_OK


def control_body(args: argparse.Namespace) -> Scope:
    """The request body the options name; ``InvalidInputError`` naming the option."""
    if args.command == "clear" and args.tenant is None:
        raise InvalidInputError("clear needs --tenant given outright (a guard: it drops pages)")
    fields: dict[str, Any] = {
        "tenant": args.tenant if args.tenant is not None else "default",
        "model": args.model,
        "namespace": args.namespace,
        "token_ids": parse_tokens(args.tokens) if args.tokens is not None else None,
        "block_hashes": _split(args.block_hashes) if args.block_hashes is not None else None,
        "lora_name": args.lora,
        "cache_salt": args.salt,
        "block_size": args.block_size,
    }
    kind: type[Scope] = PrefixRequest
    if args.command == "pin":
        kind, fields["ttl_s"] = PinRequest, args.ttl
    elif args.command == "clear":
        kind = ClearRequest
    try:
        return kind(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        where, _, message = first_problem(exc)
        option = _OPTIONS.get(where.split(".")[0], "--" + where.replace("_", "-"))
        raise InvalidInputError(f"{option}: {message}" if where else message) from None


def parse_tokens(text: str) -> list[int]:
    """``--tokens``: ids separated by commas or spaces, or ``@FILE`` holding a JSON list."""
    if text.startswith("@"):
        try:
            with open(text[1:]) as f:
                doc = json.load(f)
        except OSError as exc:
            raise InvalidInputError(f"--tokens: cannot read {text[1:]}: {exc.strerror}") from None
        except ValueError as exc:
            raise InvalidInputError(f"--tokens: {text[1:]} is not JSON: {exc}") from None
        if not isinstance(doc, list) or not all(type(t) is int for t in doc):
            raise InvalidInputError(f"--tokens: {text[1:]} must hold a JSON list of integers")
        return doc
    parts = _split(text.replace(" ", ","))
    try:
        return [int(p) for p in parts]
    except ValueError:
        bad = next(p for p in parts if not p.lstrip("-").isdigit())
        raise InvalidInputError(f"--tokens: {bad!r} is not an integer token id") from None


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def report_lines(report: ControlReport) -> list[str]:
    """A line per node and the total, for people."""
    done = _DONE.get(report.action, report.action)

    def figures(pages: int, nbytes: int, memory: int, disk: int, missing: int) -> str:
        held = f", {missing} not held" if report.action != "clear" else ""
        return (
            f"{done} {pages} page(s) ({format_size(nbytes)}): "
            f"{memory} had a memory copy, {disk} only on disk{held}"
        )

    lines = [
        f"{n.node_id:20} {figures(n.pages, n.bytes, n.memory, n.disk, n.missing)}"
        + (f"; {n.blocks} whole block(s)" if n.blocks else "")
        for n in report.nodes
    ]
    lines += [f"{node:20} unreachable: {why}" for node, why in report.unreachable.items()]
    answered = f"{len(report.nodes)} of {len(report.nodes) + len(report.unreachable)} node(s)"
    total = figures(report.pages, report.bytes, report.memory, report.disk, report.missing)
    lines.append(f"{'total':20} {total} on {answered}")
    return lines


def where_lines(report: WhereReport) -> list[str]:
    """A table per namespace: node, blocks in memory, on disk, pinned, shortest TTL."""
    lines = []
    rows = report.summary()
    for digest in sorted({r.namespace for r in rows} | set(report.stored)):
        lines.append(
            f"namespace {digest}: {report.stored.get(digest, 0)} block(s) of the prefix stored"
        )
        lines.append(
            f"  {'node':20} {'in memory':>9} {'on disk':>8} {'pinned':>7} {'shortest TTL':>13}"
        )
        for r in (r for r in rows if r.namespace == digest):
            ttl = (
                "-"
                if not r.pinned
                else "never"
                if r.shortest_ttl_s is None
                else f"{r.shortest_ttl_s:.1f} s"
            )
            lines.append(f"  {r.node_id:20} {r.memory:>9} {r.disk:>8} {r.pinned:>7} {ttl:>13}")
    if not rows and not report.stored:
        lines.append("no namespace of the prefix is registered")
    lines += [f"{node:20} unreachable: {why}" for node, why in report.unreachable.items()]
    return lines


def where_doc(report: WhereReport) -> dict[str, Any]:
    """``kvstore where --json``: each node's blocks, the merged holders, the table."""
    return {
        "residency": {
            node: {ns: [b.model_dump() for b in blocks] for ns, blocks in spaces.items()}
            for node, spaces in report.residency.items()
        },
        "holders": {
            ns: {str(block): [dataclasses.asdict(h) for h in hs] for block, hs in per_block.items()}
            for ns, per_block in report.holders().items()
        },
        "summary": [dataclasses.asdict(r) for r in report.summary()],
        "stored": report.stored,
        "unreachable": report.unreachable,
    }
