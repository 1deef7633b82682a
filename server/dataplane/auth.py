"""Who may do what on the data plane (docs/security.md).

A request's token names a credential of the node's credentials file (re-read when it
changes); a credential covers tenants, for reading or for reading and writing. The
tenant a request acts on is the one its namespace digest names (read from the index,
server/dataplane/namespaces.py), never a claim of the frame. An anonymous node
(``--anonymous``) serves every tenant to everyone."""

from __future__ import annotations

from kvstore.pages.namespace import Namespace
from kvstore.security.credentials import Credential, CredentialFile
from kvstore.wire import protocol as P
from server.dataplane.errors import Refused, Unauthorized
from server.metrics import NodeMetrics


class Authorizer:
    """Checks a request's credential: who it is, and whether it may read or write the
    namespace's tenant."""

    def __init__(self, credentials: CredentialFile, metrics: NodeMetrics) -> None:
        self.credentials = credentials
        self.metrics = metrics

    @property
    def enabled(self) -> bool:
        """Whether requests need a credential (False on an anonymous node)."""
        return self.credentials.enabled

    def identify(self, token: str) -> Credential | None:
        """The credential ``token`` names (None on an anonymous node); ``Unauthorized``
        when the node needs one and none matches."""
        credential = self.credentials.credential_for(token)
        if credential is None and self.credentials.enabled:
            self.metrics.errors.labels("auth").inc()
            raise Unauthorized("the data-plane token matches no credential of this node")
        return credential

    def authorize(self, credential: Credential | None, ns: Namespace, write: bool) -> None:
        """Refuse a request whose credential does not cover the namespace's tenant.
        ``None`` passes only on an anonymous node."""
        if credential is None and not self.credentials.enabled:
            return
        if credential is None or not credential.allows(ns.tenant, write):
            self.metrics.errors.labels("forbidden").inc()
            right = "write" if write else "read"
            raise Refused(
                P.RefusalCode.FORBIDDEN,
                f"credential {credential.name if credential else '-'} may not {right} pages of tenant {ns.tenant}",
            )
