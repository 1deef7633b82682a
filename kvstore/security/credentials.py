"""Data-plane credentials: a token grants read, or read and write, to named tenants.

Storage nodes call ``CredentialFile.credential_for(token)`` on every request and
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
import re
import secrets
from dataclasses import dataclass

from kvstore.errors import InvalidInputError
from kvstore.pages.namespace import check_tenant
from kvstore.security.watched import WatchedTable

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
    return Credential(name, rights, parse_tenants(tenants, f"credential {name}"))


def parse_tenants(tenants: list[str], what: str) -> frozenset[str] | None:
    """The tenants a credential or router key names: checked names, or None for ``*``
    (every tenant). ``InvalidInputError`` naming ``what`` for an empty list, a bad name,
    or ``*`` beside names."""
    if not tenants or tenants == [""]:
        raise InvalidInputError(f"{what}: name at least one tenant, or * for every tenant")
    if ALL_TENANTS in tenants:
        if len(tenants) > 1:
            raise InvalidInputError(f"{what}: * stands alone, not beside other tenants")
        return None
    for tenant in tenants:
        check_tenant(tenant, f"{what}: tenant")
    return frozenset(tenants)


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
    """The credentials a node accepts: those in a file (a ``WatchedTable``: re-read
    when it changes, the last good set kept when an edit breaks it) plus, optionally,
    one legacy token that grants read and write to every tenant (``--auth-token``).
    The first load must succeed (``InvalidInputError``)."""

    def __init__(self, path: str | None, legacy_token: str = "", *, recheck: float = 1.0) -> None:
        self.path = path
        self._legacy = (
            {token_digest(legacy_token): Credential("auth-token", READWRITE, None)}
            if legacy_token
            else {}
        )
        self._file = (
            WatchedTable(path, parse_credentials, "credentials", recheck=recheck) if path else None
        )

    @property
    def enabled(self) -> bool:
        """False when no credential is configured (a node started with ``--anonymous``)."""
        return self._file is not None or bool(self._legacy)

    def credential_for(self, token: str) -> Credential | None:
        """The credential ``token`` grants, or None. Re-reads the file when it changed."""
        table = self._file.table() if self._file is not None else {}
        if not token:
            return None
        digest = token_digest(token)
        return self._legacy.get(digest) or table.get(digest)
