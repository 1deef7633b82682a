"""The fan-out of the operator control API: one request sent to every live storage node
at once, the answers added up (``kvstore.control.reports``).

A node acts only on the pages it holds (``kvstore.control.requests``), so a pin, unpin,
prefetch or clear of a prefix reaches every replica only when every live node is asked;
"where" asks every node's own table the same way (the prefix query with
``residency``). Each node is asked on its metrics port (its registry entry's
``extra["metrics"]``) over plain HTTP from a thread of its own (the standard library's
``http.client``: the core package takes no HTTP library).

What the nodes answer decides what the caller sees: a node that cannot be reached,
times out or fails on its side (5xx, 404) is named in ``unreachable`` and left out of
the sums; a refusal the caller caused raises, once every node has answered: 401/403
``CredentialError``, 400 (and other 4xx) ``InvalidInputError``, 409 ``PinRefusedError``
(the pins other nodes accepted stand)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kvstore.control.reports import ControlReport, WhereReport
from kvstore.control.requests import (
    CONTROL_PATHS,
    BlockResidency,
    ClearRequest,
    NodeAction,
    PinRequest,
    PrefixRequest,
    Scope,
)
from kvstore.errors import CredentialError, InvalidInputError, PinRefusedError
from kvstore.index import NodeInfo

# Seconds a node may take to answer: a pin or prefetch reads its disk first, and the
# node itself gives up after 60 s (server/control/http.py, ANSWER_TIMEOUT_S, a 503).
CONTROL_TIMEOUT = 65.0
# Seconds to connect: a node that is down or cut off is named unreachable this soon,
# not after the answer's time.
CONNECT_TIMEOUT = 5.0
MAX_THREADS = 32  # nodes asked at once; more wait for a free thread
QUERY_PATH = "/v1/kv/query"
HASH_QUERY_PATH = "/v1/kv/query_by_hash"
# what each control path takes: a body of another kind is the caller's mistake
_BODIES: dict[str, type[Scope]] = {
    "/v1/kv/pin": PinRequest,
    "/v1/kv/unpin": PrefixRequest,
    "/v1/kv/prefetch": PrefixRequest,
    "/v1/kv/clear": ClearRequest,
}
assert set(_BODIES) == set(CONTROL_PATHS)


@dataclass(frozen=True)
class _Reply:
    """One node's answer: ``status`` 0 when it was not reached (``error`` says why),
    else the HTTP status with the JSON body (``doc``) or the error the body gave."""

    node_id: str
    status: int
    doc: Any = None
    error: str = ""


class _SpaceResidency(BaseModel):
    """What "where" reads of one namespace of a query answer (the rest is ignored)."""

    model_config = ConfigDict(extra="ignore")

    namespace: str
    blocks: int = 0
    residency: list[BlockResidency] = []


class _WhereAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    namespaces: list[_SpaceResidency] = []


class ControlCaller:
    """One job: send a control request or a "where" query to every live node
    concurrently and add up the answers. Blocking: called from any thread (the CLI's,
    or a worker thread of the client: ``client.control``). ``nodes`` gives the live
    nodes at each call (the registry as the caller reads it); ``token`` is the bearer
    token ('' for nodes that take none); ``timeout`` is each node's time to answer once
    connected (``CONNECT_TIMEOUT`` to connect), so a call takes at most their sum."""

    def __init__(
        self,
        nodes: Callable[[], list[NodeInfo]],
        token: str = "",
        timeout: float = CONTROL_TIMEOUT,
    ) -> None:
        self._nodes = nodes
        self._token = token
        self._timeout = timeout

    def call(self, path: str, body: Scope) -> ControlReport:
        """Send ``body`` to ``path`` (one of ``CONTROL_PATHS``) on every live node and
        return the sums. Raises (after every node answered) for a refusal the caller
        caused: module docstring; nodes that failed otherwise are ``unreachable``."""
        kind = _BODIES.get(path)
        if kind is None:
            raise InvalidInputError(f"no control path {path!r}: one of {', '.join(CONTROL_PATHS)}")
        if not isinstance(body, kind):
            raise InvalidInputError(f"{path} takes a {kind.__name__}, not a {type(body).__name__}")
        action = path.rsplit("/", 1)[1]
        replies, unreachable = self._ask_all(path, body.model_dump(exclude_none=True))
        acted: list[NodeAction] = []
        for r in (r for r in replies if r.status == 200):
            try:
                acted.append(NodeAction.model_validate(r.doc))
            except ValidationError:
                unreachable[r.node_id] = f"answered an unreadable body: {str(r.doc)[:200]}"
        report = ControlReport.of(action, acted, unreachable)
        _raise_refusals(replies, action, body.tenant, report)
        return report

    def where(self, body: PrefixRequest) -> WhereReport:
        """Where the prefix ``body`` names lies: every live node's own table, asked
        through the prefix query with ``residency`` (``/v1/kv/query`` for the token
        form, ``/v1/kv/query_by_hash`` for the hash form). Raises as ``call`` does."""
        path, doc = _query_of(body)
        replies, unreachable = self._ask_all(path, doc)
        report = WhereReport()
        for r in (r for r in replies if r.status == 200):
            try:
                answer = _WhereAnswer.model_validate(r.doc)
            except ValidationError:
                unreachable[r.node_id] = f"answered an unreadable body: {str(r.doc)[:200]}"
                continue
            spaces = report.residency.setdefault(r.node_id, {})
            for space in answer.namespaces:
                spaces[space.namespace] = sorted(space.residency, key=lambda b: b.block)
                stored = report.stored.get(space.namespace, 0)
                report.stored[space.namespace] = max(stored, space.blocks)
        report.unreachable = dict(sorted(unreachable.items()))
        _raise_refusals(replies, "where", body.tenant, None)
        return report

    # ---- asking the nodes ----------------------------------------------------------

    def _ask_all(self, path: str, doc: dict[str, Any]) -> tuple[list[_Reply], dict[str, str]]:
        """Every live node's reply to ``doc`` at ``path``, asked at once: the replies
        with a status below 500 other than 404, and node id -> why for the others."""
        nodes = self._nodes()
        data = json.dumps(doc).encode()
        if not nodes:
            return [], {}
        with ThreadPoolExecutor(min(len(nodes), MAX_THREADS), "kvstore-control") as pool:
            replies = list(pool.map(lambda n: self._ask(n, path, data), nodes))
        answered, unreachable = [], {}
        for r in replies:
            if r.status == 0:
                unreachable[r.node_id] = r.error
            elif r.status >= 500:
                unreachable[r.node_id] = f"answered {r.status}: {r.error}"
            elif r.status == 404:
                # a node older than the control API, or a path it does not serve
                unreachable[r.node_id] = f"does not serve {path} (404: {r.error})"
            else:
                answered.append(r)
        return answered, unreachable

    def _ask(self, node: NodeInfo, path: str, data: bytes) -> _Reply:
        """POST ``data`` to ``path`` on ``node``'s metrics port; never raises."""
        address = node.extra.get("metrics")
        if not address:
            return _Reply(node.node_id, 0, error="no metrics port in its registry entry")
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        conn = http.client.HTTPConnection(address, timeout=min(CONNECT_TIMEOUT, self._timeout))
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(self._timeout)
            conn.request("POST", path, data, headers)
            resp = conn.getresponse()
            status, raw = resp.status, resp.read()
        except TimeoutError:
            took = "connect" if conn.sock is None else f"answer in {self._timeout:g} s"
            return _Reply(node.node_id, 0, error=f"{address} did not {took}")
        except (OSError, http.client.HTTPException) as exc:
            return _Reply(node.node_id, 0, error=f"{address}: {exc or type(exc).__name__}")
        finally:
            conn.close()
        try:
            doc = json.loads(raw)
        except ValueError:
            text = raw[:200].decode(errors="replace")
            if status == 200:  # an answer that cannot be read is no answer
                return _Reply(node.node_id, 0, error=f"answered a body that is not JSON: {text!r}")
            return _Reply(node.node_id, status, error=text)
        error = doc.get("error", "") if isinstance(doc, dict) else ""
        return _Reply(node.node_id, status, doc, str(error))


def _named(errors: dict[str, str]) -> str:
    """'node a (why); node b (why)', by node id."""
    return "; ".join(f"node {node} ({why})" for node, why in sorted(errors.items()))


def _query_of(body: PrefixRequest) -> tuple[str, dict[str, Any]]:
    """The prefix query that asks for ``body``'s prefix with residency: the token form
    at ``/v1/kv/query``, the hash form at ``/v1/kv/query_by_hash`` (which takes no
    adapter, salt or block size: the hashes carry them)."""
    fields: tuple[str, ...]
    if body.token_ids is not None:
        fields = ("model", "token_ids", "lora_name", "cache_salt", "block_size", "tenant")
        path = QUERY_PATH
    else:
        fields = ("block_hashes", "namespace", "model", "tenant")
        path = HASH_QUERY_PATH
    doc = {f: getattr(body, f) for f in fields if getattr(body, f) is not None}
    return path, {**doc, "residency": True}


def _raise_refusals(
    replies: list[_Reply], action: str, tenant: str, report: ControlReport | None
) -> None:
    """Raise for the refusals among ``replies``: the token first (nothing else can
    succeed without it), then a bad request, then a pin the nodes' limits refused."""
    by_status: dict[int, dict[str, str]] = {}
    for r in replies:
        if r.status != 200:
            by_status.setdefault(r.status, {})[r.node_id] = r.error or f"HTTP {r.status}"
    token = {**by_status.pop(401, {}), **by_status.pop(403, {})}
    if token:
        right, verb = ("read", "look up") if action == "where" else ("read-write", action)
        raise CredentialError(
            f"{_named(token)} refused to {verb} pages of tenant {tenant!r} for the token given. "
            f"Pass a token with {right} rights on tenant {tenant!r}: auth_token=... to the client, or "
            f"KVSTORE_AUTH_TOKEN / KVSTORE_AUTH_TOKEN_FILE in the environment (docs/security.md)",
            node_ids=sorted(token),
            tenant=tenant,
            operation=action,
        )
    refused = by_status.pop(409, {})
    bad = {node: why for errors in by_status.values() for node, why in errors.items()}
    if bad:
        raise InvalidInputError(f"{_named(bad)} refused the {action} request")
    if refused:
        accepted = report.nodes if report is not None else []
        stand = f"; the pins of {', '.join(n.node_id for n in accepted)} stand" if accepted else ""
        raise PinRefusedError(
            f"{_named(refused)} refused to {action}{stand}",
            refusals=refused,
            accepted=report,
        )
