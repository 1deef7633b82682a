"""The secrets of the ``kvstore`` commands: ``credential`` (a data-plane token and its
credentials-file line), ``events-key`` (CURVE key pairs of the event stream and a
router's routers-file line), ``acl`` (the index's ACL rules), the index URL and password a
command reads from the environment, and files only this user can read."""

from __future__ import annotations

import argparse
import os
import sys

from kvstore.errors import InvalidInputError
from kvstore.security.credentials import make_credential, new_token, token_digest


def index_from_env() -> tuple[str, str | None]:
    """The index URL and password from KVSTORE_REDIS_URL and KVSTORE_REDIS_PASSWORD(_FILE),
    read and checked once, as a client reads them."""
    from kvstore.settings.client import client_options_from_env

    options = client_options_from_env()
    return options.redis_url, options.redis_password.get_secret_value() or None


def write_secret(path: str, text: str) -> None:
    """Create ``path`` readable by this user only (never over an existing file) holding ``text``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def run_credential(args: argparse.Namespace) -> int:
    """Write a new token to ``--token-file`` (mode 0600, never overwritten) and print the
    line that grants it, for the nodes' credentials file. The token is never printed."""
    credential = make_credential(args.name, args.rights, args.tenant)
    token = new_token()
    try:
        write_secret(args.token_file, token + "\n")
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


def run_acl(args: argparse.Namespace) -> int:
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


def run_events_key(args: argparse.Namespace) -> int:
    """Write a CURVE key pair into ``--out`` (``<name>.key`` public, ``<name>.key_secret``
    mode 0600, never overwritten). For a node (``events-key node``) print its public key
    (what routers pin); for a router print its routers-file line. The secret key is
    never printed."""
    from kvstore.security.routers import make_router_key, new_key_files

    if args.role == "router" and not args.tenant:
        raise InvalidInputError("a router key names --tenant (repeat for several; * for all)")
    if args.role == "node" and args.tenant:
        raise InvalidInputError("--tenant names what a router reads; a node key takes none")
    name = args.name or ("node" if args.role == "node" else "")
    if not name:
        raise InvalidInputError("a router key needs --name (shown in the routers file and logs)")
    if args.role == "router":
        make_router_key(name, "0" * 40, args.tenant)  # the name and tenants, checked first
    public, secret_file = new_key_files(args.out, name)
    if args.role == "node":
        print(public)
        print(
            f"node key written to {secret_file}: give it to --kv-events-key-file; routers "
            "pin the public key above (printed, and in the .key file beside it)",
            file=sys.stderr,
        )
    else:
        print(make_router_key(name, public, args.tenant).line())
        print(
            f"router key written to {secret_file}: the router's subscriber uses it, with the "
            "node's public key; add the line above to the nodes' --kv-events-routers-file",
            file=sys.stderr,
        )
    return 0
