"""The secrets of the ``kvstore`` commands: ``credential`` (a data-plane token and its
credentials-file line), ``acl`` (the index's ACL rules), the index URL and password a
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
    from kvstore.settings.config import client_options_from_env

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
