"""Event-stream credentials: which routers may subscribe to a node's KV events, and
which tenants' events each one reads (docs/security.md, "KV event stream").

A router is a principal, like a tenant's token. It holds a CURVE key pair (ZeroMQ's
built-in public-key authentication, which also encrypts the stream); the node holds
its own key pair (``--kv-events-key-file``) and a file of the routers' public keys
(``--kv-events-routers-file``), one router per line::

    # name     public key (Z85, 40 characters)           tenants
    router-a   rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7   team-a
    llm-d      Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID   team-a,team-b
    ops        E&=AYQ=p8!$LUE.V8Jw!BcF0c4h[ltnH*9V3QNgP   *

Only whole lines starting with ``#`` are comments: Z85 text may hold a ``#``.

Key files are ZeroMQ's certificate files (``zmq.auth.create_certificates``:
``<name>.key`` holds the public key, ``<name>.key_secret`` both), which czmq and
pyzmq tools read. ``kvstore events-key`` makes them. The node re-reads the routers
file when it changes (a Secret update), so a router's key rotates without a restart:
add the new line, move the router, remove the old line."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import zmq.auth

from kvstore.errors import InvalidInputError
from kvstore.security.credentials import ALL_TENANTS, parse_tenants
from kvstore.security.watched import WatchedTable

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
_Z85_RE = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


@dataclass(frozen=True)
class RouterKey:
    """One router: its ``name``, CURVE public key (Z85 text) and the tenants whose
    events it may read (``None``: every tenant)."""

    name: str
    public_key: str
    tenants: frozenset[str] | None

    def reads(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants

    def line(self) -> str:
        tenants = ALL_TENANTS if self.tenants is None else ",".join(sorted(self.tenants))
        return f"{self.name} {self.public_key} {tenants}"


def make_router_key(name: str, public_key: str, tenants: list[str]) -> RouterKey:
    """A checked ``RouterKey``; a bad field raises ``InvalidInputError`` naming it."""
    if not _NAME_RE.match(name):
        raise InvalidInputError(f"router name {name!r} must be 1-64 letters, digits or _.@-")
    if not _Z85_RE.match(public_key):
        raise InvalidInputError(
            f"router {name}: the public key must be 40 characters of Z85 text "
            "(the public-key line of a ZeroMQ certificate file)"
        )
    return RouterKey(name, public_key, parse_tenants(tenants, f"router {name}"))


def parse_router_keys(text: str, source: str = "router keys") -> dict[str, RouterKey]:
    """Public key -> router for every line of ``text``; a bad line raises
    ``InvalidInputError`` naming the source and line number."""
    out: dict[str, RouterKey] = {}
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 3:
            raise InvalidInputError(
                f"{source} line {number}: expected 'name public-key tenants', got {len(fields)} fields"
            )
        try:
            key = make_router_key(fields[0], fields[1], fields[2].split(","))
        except InvalidInputError as exc:
            raise InvalidInputError(f"{source} line {number}: {exc}") from None
        if key.public_key in out:
            raise InvalidInputError(
                f"{source} line {number}: the key of {key.name} is already listed as "
                f"{out[key.public_key].name}"
            )
        if key.name in names:
            raise InvalidInputError(f"{source} line {number}: router {key.name} is listed twice")
        names.add(key.name)
        out[key.public_key] = key
    return out


def router_keys(path: str, *, recheck: float = 1.0) -> WatchedTable[RouterKey]:
    """The routers file at ``path``, re-read when it changes (the first read must
    succeed: ``InvalidInputError``)."""
    return WatchedTable(path, parse_router_keys, "router keys", recheck=recheck)


def load_key_pair(path: str, what: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a ZeroMQ secret certificate file
    (``<name>.key_secret``); ``InvalidInputError`` naming ``what`` when the file is
    missing, unreadable or holds no secret key."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{what} {path}: {exc}") from None
    if not secret:
        raise InvalidInputError(
            f"{what} {path} holds no secret key: give the <name>.key_secret file, not <name>.key"
        )
    return public, secret


def new_key_files(directory: str, name: str) -> tuple[str, str]:
    """Write a fresh CURVE key pair as ``<directory>/<name>.key`` (public) and
    ``<name>.key_secret`` (both; mode 0600); returns (public key Z85, secret file path).
    Refuses to overwrite an existing pair (``InvalidInputError``)."""
    if not _NAME_RE.match(name):
        raise InvalidInputError(f"key name {name!r} must be 1-64 letters, digits or _.@-")
    secret_path = os.path.join(directory, f"{name}.key_secret")
    for path in (secret_path, os.path.join(directory, f"{name}.key")):
        if os.path.exists(path):
            raise InvalidInputError(f"{path} exists; remove it or choose another name")
    os.makedirs(directory, exist_ok=True)
    old = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        _, secret_file = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    public, _ = load_key_pair(secret_file, "new key file")
    return public.decode("ascii"), secret_file
