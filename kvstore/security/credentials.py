"""Data-plane credentials: a token grants read, or read and write, to named tenants.

Storage nodes call ``CredentialFile.find(token)`` on every request and
``Credential.allows`` once the request's namespace is known (its tenant is part of the
namespace the digest names, read from the index, so a frame cannot claim another
tenant). Nodes hold only SHA-256 digests of tokens: a leaked credentials file grants
nothing. Tokens are 256-bit random strings (``new_token``), so an unsalted fast hash is
enough; a password hash would only slow every request.

The file has one credential per line (``#`` starts a comment)::

    # name       sha256 of the token                                       rights     tenants
    engine-a     sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  readwrite  team-a
    dashboards   sha256:...                                                read       team-a,team-b
    operators    sha256:...                                                readwrite  *

``kvstore credential`` writes a new token to a file and prints its line. The node
re-reads the file when it changes (a Kubernetes Secret update swaps the file), so
credentials rotate without a restart: add the new line, move clients over, remove the
old line."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass

from kvstore.errors import InvalidInputError
from kvstore.pages.namespace import check_tenant

log = logging.getLogger(__name__)

READ = "read"
READWRITE = "readwrite"
RIGHTS = (READ, READWRITE)
ALL_TENANTS = "*"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")


def token_digest(token: str) -> str:
    """The hex SHA-256 of a token, as the credentials file stores it."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Credential:
    """What one token may do: ``rights`` on ``tenants`` (``None``: every tenant)."""

    name: str
    rights: str
    tenants: frozenset[str] | None

    def allows(self, tenant: str, write: bool) -> bool:
        """True when this credential may read (or, with ``write``, write) ``tenant``."""
        if write and self.rights != READWRITE:
            return False
        return self.tenants is None or tenant in self.tenants

    def line(self, digest: str) -> str:
        tenants = ALL_TENANTS if self.tenants is None else ",".join(sorted(self.tenants))
        return f"{self.name} sha256:{digest} {self.rights} {tenants}"


def make_credential(name: str, rights: str, tenants: list[str]) -> Credential:
    """A checked ``Credential``; a bad field raises ``InvalidInputError`` naming it."""
    if not _NAME_RE.match(name):
        raise InvalidInputError(f"credential name {name!r} must be 1-64 letters, digits or _.@-")
    if rights not in RIGHTS:
        raise InvalidInputError(
            f"credential {name}: rights must be one of {list(RIGHTS)}, got {rights!r}"
        )
    if not tenants:
        raise InvalidInputError(
            f"credential {name}: name at least one tenant, or * for every tenant"
        )
    if ALL_TENANTS in tenants:
        if len(tenants) > 1:
            raise InvalidInputError(f"credential {name}: * stands alone, not beside other tenants")
        return Credential(name, rights, None)
    for tenant in tenants:
        check_tenant(tenant, f"credential {name}: tenant")
    return Credential(name, rights, frozenset(tenants))


def parse_credentials(text: str, source: str = "credentials") -> dict[str, Credential]:
    """Token digest -> credential for every line of ``text``; a bad line raises
    ``InvalidInputError`` naming the source and line number."""
    out: dict[str, Credential] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 4:
            raise InvalidInputError(
                f"{source} line {number}: expected 'name sha256:<hex> rights tenants', got {len(fields)} fields"
            )
        name, digest, rights, tenants = fields
        match = _DIGEST_RE.match(digest)
        if not match:
            raise InvalidInputError(
                f"{source} line {number}: the token digest must be sha256: and 64 lowercase hex digits"
            )
        try:
            credential = make_credential(name, rights, tenants.split(","))
        except InvalidInputError as exc:
            raise InvalidInputError(f"{source} line {number}: {exc}") from None
        if match.group(1) in out:
            raise InvalidInputError(
                f"{source} line {number}: the token of {name} is already listed as {out[match.group(1)].name}"
            )
        out[match.group(1)] = credential
    return out


class CredentialFile:
    """The credentials a node accepts: those in a file (re-read when it changes, checked
    at most once per ``recheck`` seconds) plus, optionally, one legacy token that grants
    read and write to every tenant (``--auth-token``).

    A file that turns unreadable or malformed keeps the last good set and logs an error
    on each check, so a bad edit neither locks every client out nor lets anyone in; the
    first load must succeed (``InvalidInputError``)."""

    def __init__(self, path: str | None, legacy_token: str = "", *, recheck: float = 1.0) -> None:
        self.path = path
        self.recheck = recheck
        self._legacy = (
            {token_digest(legacy_token): Credential("auth-token", READWRITE, None)}
            if legacy_token
            else {}
        )
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._table: dict[str, Credential] = dict(self._legacy)
        self.reloads = 0
        self.reload_errors = 0
        if path:
            self._load(initial=True)

    @property
    def enabled(self) -> bool:
        """False when no credential is configured (a node started with ``--anonymous``)."""
        return bool(self.path) or bool(self._legacy)

    def _load(self, initial: bool = False) -> None:
        assert self.path
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            with open(self.path) as f:
                table = parse_credentials(f.read(), self.path)
        except (OSError, InvalidInputError) as exc:
            message = exc.strerror if isinstance(exc, OSError) else str(exc)
            if initial:
                raise InvalidInputError(
                    f"cannot load credentials file {self.path}: {message}"
                ) from None
            self.reload_errors += 1
            log.error(
                "credentials file %s not reloaded, keeping the %d credentials loaded before: %s",
                self.path,
                len(self._table),
                message,
            )
            return
        self._table = {**table, **self._legacy}
        self._stamp = stamp
        if not initial:
            self.reloads += 1
            log.info("credentials file %s reloaded: %d credentials", self.path, len(table))

    def find(self, token: str) -> Credential | None:
        """The credential ``token`` grants, or None. Re-reads the file when it changed."""
        if self.path:
            now = time.monotonic()
            if now - self._checked >= self.recheck:
                with self._lock:
                    if now - self._checked >= self.recheck:
                        self._load()
                        self._checked = now
        if not token:
            return None
        return self._table.get(token_digest(token))
