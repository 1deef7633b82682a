"""What a node refusing the client's token means for a call: the node is healthy (not
suspected), the client is misconfigured. Each refusal is counted and logged; a call
that every node it asked refused raises ``CredentialError`` (a ``PermissionError``),
since a miss would hide the misconfiguration; a call where some node failed otherwise
(down, stalled) stays a miss."""

from __future__ import annotations

import logging
from typing import Literal

from client.log_limit import LogLimit
from client.nodes.calls import NodeRefusedError
from client.stats import ClientStats
from kvstore.errors import CredentialError

log = logging.getLogger(__name__)
# a refused token repeats with every call: at most a line a minute per tenant and node
_LIMIT = LogLimit(log)
Verb = Literal["store", "read"]


class CallRefusals:
    """One job: collect the credential refusals of one put or get (``Publisher``,
    ``ReplicaFetcher`` make one per call) and raise once every node asked refused.
    Used on the client's event loop only."""

    def __init__(self, stats: ClientStats, tenant: str, verb: Verb) -> None:
        self._stats = stats
        self._tenant = tenant
        self._verb = verb
        self._refusals: list[NodeRefusedError] = []

    def add_refusal(self, exc: NodeRefusedError) -> None:
        """A node refused this client's token: counted and logged."""
        self._stats.credential_refusals += 1
        self._refusals.append(exc)
        _LIMIT.warning(f"{self._tenant} {exc.node_id}", "%s", exc)

    def raise_if_all(self, asked: set[str]) -> None:
        """Raise ``CredentialError`` when every node in ``asked`` refused the token."""
        refusals = self._refusals
        if not refusals or {r.node_id for r in refusals} != asked:
            return
        tenant, verb = self._tenant, self._verb
        right = "read/write" if verb == "store" else "read"
        why = "; ".join(f"{r.node_id}: {r.code.value}: {r.message}" for r in refusals)
        raise CredentialError(
            f"every node asked refused to {verb} pages of tenant {tenant!r} for this client's credentials "
            f"({why}). Pass the data-plane token the nodes accept, with {right} rights on tenant {tenant!r}: "
            f"auth_token=... to the client, or KVSTORE_AUTH_TOKEN / KVSTORE_AUTH_TOKEN_FILE in the environment "
            f"(read by the constructor for options not passed); `kvstore up` prints KVSTORE_AUTH_TOKEN_FILE=..., "
            f"a tenant's token comes from the nodes' --credentials-file (docs/security.md)",
            node_ids=sorted(asked),
            tenant=tenant,
            operation=verb,
        )
