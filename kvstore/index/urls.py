"""Index URLs: which forms name one server or a cluster, the seeds of a cluster, and
a URL's password kept out of messages and command lines.

URL forms (docs/key-format.md "Index URL"):

- ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS), ``unix:///path``:
  one Redis/Valkey server;
- ``redis+cluster://[user:password@]host:port[,host:port...]`` and ``rediss+cluster://``:
  a Redis/Valkey Cluster. The hosts are seeds; ``kvstore.index.routing`` reads the slot
  map from the first that answers (``CLUSTER SLOTS``) and talks to every shard's primary
  directly."""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit, urlunsplit

from kvstore.errors import InvalidInputError

SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def redact_url(url: str) -> str:
    """The URL with any password replaced (in the user-info or a ``password=`` query
    parameter, which redis-py also reads), for messages and logs."""
    parts = urlsplit(url)
    netloc, query = parts.netloc, parts.query
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rsplit('@', 1)[1]}"
    if query:
        query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", query)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def split_password(url: str) -> tuple[str, str | None]:
    """``url`` without its password (user-info, or a ``password=`` query parameter)
    and that password, unquoted (None when it has none), so that a launcher can put
    the URL on a command line and hand the password over in the environment."""
    parts = urlsplit(url)
    netloc, password = parts.netloc, parts.password
    if password is not None:
        host = netloc.rsplit("@", 1)[1]
        netloc = f"{parts.username}@{host}" if parts.username else host
        password = unquote(password)
    kept = []
    for item in parts.query.split("&") if parts.query else []:
        if item.lower().startswith("password="):
            password = password if password is not None else unquote(item[len("password=") :])
        else:
            kept.append(item)
    if password is None:
        return url, None
    # spelled out: urlunsplit drops the empty host of unix:///path
    query = "?" + "&".join(kept) if kept else ""
    fragment = "#" + parts.fragment if parts.fragment else ""
    return f"{parts.scheme}://{netloc}{parts.path}{query}{fragment}", password


def check_url(url: str) -> str:
    """``url`` when it is an index URL this module can use, else ``InvalidInputError``."""
    scheme = urlsplit(url).scheme
    if scheme not in SINGLE_SCHEMES + CLUSTER_SCHEMES:
        raise InvalidInputError(
            "Redis URL must start with redis://, rediss://, unix://, redis+cluster:// or "
            f"rediss+cluster://, got {redact_url(url)!r}"
        )
    if scheme in CLUSTER_SCHEMES and not urlsplit(url).netloc.rsplit("@", 1)[-1]:
        raise InvalidInputError(
            f"a cluster URL needs at least one host:port, got {redact_url(url)!r}"
        )
    return url


def seed_urls(url: str) -> list[str]:
    """Single-server URLs: the URL itself, or one per seed host of a cluster URL."""
    parts = urlsplit(check_url(url))
    if parts.scheme not in CLUSTER_SCHEMES:
        return [url]
    creds, _, hosts = parts.netloc.rpartition("@")
    scheme = parts.scheme.split("+", 1)[0]
    return [
        urlunsplit((scheme, f"{creds}@{h}" if creds else h, "", parts.query, ""))
        for h in hosts.split(",")
        if h
    ]
