"""Every exception this package raises on purpose, in one tree:

    KVStoreError
    ├── InvalidInputError (also a ValueError)   the caller passed something malformed:
    │                                           always propagates
    ├── CredentialError (also a PermissionError) every node asked refused the client's
    │                                           token (none, wrong, or lacking the right):
    │                                           configuration, not a fault; propagates
    ├── PinRefusedError                         a node's limits refused a pin (its share
    │                                           of memory, the tenant's quota); pins
    │                                           other nodes accepted stand
    ├── SetupError                              how the store was set up or started:
    │   ├── NodeIdInUseError                    another live node holds this node id
    │   └── PortInUseError                      a port the node was told to use is taken
    └── Fault                                   turns into a miss or a shorter prefix,
        │                                       never wrong KV
        ├── RemoteFault                         a remote component failed; never the
        │   │                                   caller's fault
        │   ├── IndexUnavailableError (also a ConnectionError)
        │   │   └── IndexTimeoutError           it did not answer in time: slow or
        │   │                                   unreachable, not known to be down
        │   ├── FencedError                     the index no longer accepts a node's
        │   │                                   incarnation
        │   ├── TransportError                  a node unreachable, timed out or refusing
        │   │   │                               (the client's NodeRefusedError)
        │   └── ProtocolError                   a malformed, truncated or oversized frame
        └── IndexScriptError                    the index rejected a script call: a bug or
                                                an incompatible server, logged at ERROR
                                                and counted apart, but still a miss

Where failures of other libraries become these: Redis errors in
``kvstore.index.routing`` (``_failure``), UCX errors in ``kvstore.wire.transport``
(``_settled`` and ``listen``)."""

from __future__ import annotations

from typing import Any


class KVStoreError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidInputError(KVStoreError, ValueError):
    """An argument is malformed: wrong shape, dtype, hash length, an empty list..."""


class CredentialError(KVStoreError, PermissionError):
    """Every storage node a put or get asked refused it for its credentials (no token,
    a wrong one, or one without the right on the tenant): a configuration error, raised
    by ``insert``/``put_pages``/``select``/``get_pages`` rather than read as a miss. A
    node that is down or stalled is still a miss (``Fault``). ``node_ids``, ``tenant``
    and ``operation`` say who refused what."""

    def __init__(self, message: str, *, node_ids: list[str], tenant: str, operation: str) -> None:
        super().__init__(message)
        self.node_ids = node_ids
        self.tenant = tenant
        self.operation = operation


class PinRefusedError(KVStoreError):
    """A pin (``kvstore.control``: ``KVCacheClient.pin``, ``kvstore pin``) that one or
    more nodes refused for their limits (the share of memory pins may take, the
    tenant's pin quota): HTTP 409. Raised once every node has answered; the pins the
    other nodes accepted stand (unpin them, or let their TTL run out). ``refusals``:
    node id -> the node's reason; ``accepted``: the report of the nodes that pinned
    (a ``kvstore.control.caller.ControlReport``)."""

    def __init__(self, message: str, *, refusals: dict[str, str], accepted: Any) -> None:
        super().__init__(message)
        self.refusals = refusals
        self.accepted = accepted


class SetupError(KVStoreError):
    """The store cannot run as it was set up (an id or a port another process holds)."""


class NodeIdInUseError(SetupError):
    """Another live storage node is registered under the same node id."""


class PortInUseError(SetupError):
    """A port the node was told to listen on is taken."""


class Fault(KVStoreError):
    """What readers turn into a miss or a shorter prefix (and writers into pages not
    stored): a remote failure, or the index rejecting a script."""


class RemoteFault(Fault):
    """A remote component (index, storage node, network) failed; never the caller's fault."""


class IndexUnavailableError(RemoteFault, ConnectionError):
    """Redis/Valkey could not be reached or answered with a transport error."""


class IndexTimeoutError(IndexUnavailableError):
    """Redis/Valkey did not answer within the caller's timeout (a lookup's budget, say):
    the index may be alive and slow, or this machine loaded, so it is not called
    unreachable."""


class FencedError(RemoteFault):
    """A storage node acted under an incarnation the index no longer accepts (another
    process took over its node id, or the index lost its registration)."""


class TransportError(RemoteFault):
    """A storage node could not be reached, timed out or refused the request."""


class TransportTimeoutError(TransportError):
    """A storage node did not answer within the caller's time limit: slow, stalled or
    cut off by the network, not known to be down (``ClientStats.node_timeouts``)."""


class ProtocolError(RemoteFault):
    """A frame on the data plane is malformed, truncated or too large."""


class IndexScriptError(Fault):
    """The index answered a script call with an error: a bug, not a fault to hide."""


class IndexPermissionError(IndexScriptError):
    """The index refused a command the caller's ACL user may not run (NOPERM): its
    rules are older or narrower than its role's (docs/security.md)."""


def first_problem(exc: Any) -> tuple[str, Any, str]:
    """Pydantic's first error of ``exc`` (a ``ValidationError``) as the dotted name of
    the field ('' for the model as a whole), the input as given, and the message
    (without pydantic's "Value error, " prefix). Every place that turns a validation
    error into one line starts here (secrets are hidden by
    ``kvstore.settings.config.first_error``)."""
    err = exc.errors()[0]
    return (
        ".".join(map(str, err["loc"])),
        err.get("input"),
        str(err["msg"]).removeprefix("Value error, "),
    )
