"""The prefix query API for routers that ask instead of listening to events:
``POST /v1/kv/query`` (token ids) and ``POST /v1/kv/query_by_hash`` (the store's block
hashes), served on every node's metrics port (server/health.py).

A router knows a model name and token ids, not kvstore's namespaces (dtype, geometry,
layout, head groups). ``PrefixQuery`` reads the namespaces registered under the model
(and tenant) from the index's namespace registry (cached for ``REGISTRY_TTL``), hashes
the tokens as a client would for each (kvstore.pages.hashing, with the adapter and
salt as a ``RequestIdentity``), and asks the index in one round trip per namespace,
the one ``KVCacheClient.lookup`` makes (``PageIndex.lookup``, with the live nodes read in
the same round trip). The answer per namespace: the longest stored prefix in tokens
and blocks, the blocks each live node holds of it, and, for the answering node, how
many of them are in its memory ("CPU") and only on its disk ("DISK"); the best
namespace's figures on top. A hybrid state-space model's attention pages count up to
its last boundary state stored (``PageLayout.sparse``, client.vllm.states: what an
engine can load), asked in one more round trip; the states' own namespaces are not
listed. ``query_by_hash`` answers the namespace its hashes are of, unpaired.

Authorized like the data plane: the bearer token (``Authorization: Bearer <token>``)
must name a credential of the node's credentials file that may read the tenant asked
(default "default"); an anonymous node answers everyone. A tenant's token therefore
sees only that tenant's pages (the tenant is part of every namespace key).

Runs on the HTTP server's threads, never on the node's event loop: it has its own
blocking index connection (one at a time, under a lock), and reads the page table's
dict and page attributes without the loop (single reads, atomic under the GIL; a page
that moves meanwhile is counted in the tier it was in when read)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvstore.control.requests import BlockResidency
from kvstore.errors import KVStoreError
from kvstore.events import MEDIUM_CPU, MEDIUM_DISK
from kvstore.index import IndexLookup, NodeInfo, PageIndex
from kvstore.index.records import live_records
from kvstore.pages.hashing import HASH_BYTES
from kvstore.pages.heads import rank_units, unit_hashes
from kvstore.pages.identity import RequestIdentity
from kvstore.pages.layouts import LAYOUTS
from kvstore.pages.namespace import TENANT_PATTERN, Namespace
from kvstore.security.credentials import CredentialFile
from server.page import PageKey
from server.prefix_keys import block_keys, prefix_chain
from server.query_body import QueryParams, binary_query, json_query
from server.store import PageStore

REGISTRY_TTL = 2.0  # seconds the namespace registry read is reused (new models appear this late)
MAX_QUERY_BYTES = 16 << 20  # a request body past this is refused before it is read
MAX_TOKENS = 1 << 22


class HashQueryRequest(BaseModel):
    """``POST /v1/kv/query_by_hash``: the store's block hashes (32 hex digits each, as
    the node's events carry them) in prefix order, of the namespace ``namespace`` (its
    digest) or of every namespace of ``model``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_hashes: list[str] = Field(min_length=1)
    namespace: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")
    model: str | None = Field(None, min_length=1)
    tenant: str = Field("default", pattern=TENANT_PATTERN)
    residency: bool = False

    @model_validator(mode="after")
    def _named(self) -> HashQueryRequest:
        if self.namespace is None and self.model is None:
            raise ValueError("give namespace (a digest) or model")
        return self

    def joined(self) -> bytes:
        try:
            raw = [bytes.fromhex(h) for h in self.block_hashes]
        except ValueError:
            raise ValueError("block_hashes must be hex strings") from None
        if any(len(h) != HASH_BYTES for h in raw):
            raise ValueError(f"block hashes are {HASH_BYTES} bytes ({2 * HASH_BYTES} hex digits)")
        return b"".join(raw)


class NodeBlocks(BaseModel):
    """Blocks of the prefix one live node holds (every unit of the block there);
    ``tiers``: of those, in its memory and only on its disk (the answering node only)."""

    node_id: str
    blocks: int
    tiers: dict[str, int] | None = None


class NamespaceAnswer(BaseModel):
    namespace: str
    tenant: str
    dtype: str
    layout: str
    block_size: int
    blocks: int
    tokens: int
    nodes: list[NodeBlocks]
    # with ``residency`` asked: the blocks this node holds (server/control/ops.py)
    residency: list[BlockResidency] | None = None


class QueryAnswer(BaseModel):
    """The best namespace's prefix on top (the most tokens), then every namespace's."""

    model: str | None
    tokens: int
    blocks: int
    answered_by: str
    namespaces: list[NamespaceAnswer]


class QueryRefused(Exception):
    """An HTTP error: ``status`` and a message for the body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Registry:
    read_at: float
    spaces: list[Namespace]


class PrefixQuery:
    """Answers the two query paths; built by the node, called by the HTTP server's
    threads (``handle``)."""

    def __init__(
        self,
        index: PageIndex,
        credentials: CredentialFile,
        store: PageStore,
        node_id: str,
        residency: Callable[[list[list[PageKey]]], list[BlockResidency]] | None = None,
    ) -> None:
        self.residency = residency  # the node's table, per block (the control API's)
        self.index = index
        self.credentials = credentials
        self.store = store
        self.node_id = node_id
        self._lock = threading.Lock()  # one index connection, one query at a time on it
        self._registry: _Registry | None = None

    def handle(
        self, target: str, body: bytes, authorization: str, content_type: str = ""
    ) -> tuple[int, bytes]:
        """(HTTP status, JSON body) for a POST to ``target`` (path and query string)."""
        path, _, query_string = target.partition("?")
        try:
            if path == "/v1/kv/query":
                params, tokens = (
                    binary_query(query_string, body)
                    if content_type.startswith("application/octet-stream")
                    else json_query(body)
                )
                self.authorize(authorization, params.tenant)
                answer = self.query(params, tokens)
            elif path == "/v1/kv/query_by_hash":
                hreq = HashQueryRequest.model_validate_json(body)
                self.authorize(authorization, hreq.tenant)
                answer = self.query_by_hash(hreq)
            else:
                raise QueryRefused(404, f"no such path {path}")
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            return 400, _error(f"invalid request: {where}: {first['msg']}")
        except ValueError as exc:
            return 400, _error(f"invalid request: {exc}")
        except QueryRefused as exc:
            return exc.status, _error(str(exc))
        except KVStoreError as exc:
            return 503, _error(f"the index could not answer: {exc}")
        return 200, answer.model_dump_json(exclude_none=True).encode()

    def authorize(self, authorization: str, tenant: str, write: bool = False) -> None:
        """Raise ``QueryRefused`` (401, 403) unless the bearer token may read (or write)
        ``tenant``: the query API reads, the control API (server/control/) writes."""
        if not self.credentials.enabled:
            return
        token = (
            authorization.removeprefix("Bearer ").strip()
            if authorization.startswith("Bearer ")
            else ""
        )
        credential = self.credentials.credential_for(token) if token else None
        if credential is None:
            raise QueryRefused(401, "the bearer token matches no credential of this node")
        if not credential.allows(tenant, write=write):
            verb = "change" if write else "read"
            raise QueryRefused(
                403, f"credential {credential.name} may not {verb} pages of tenant {tenant}"
            )

    # ---- the two queries ------------------------------------------------------------------

    def query(self, req: QueryParams, tokens: np.ndarray) -> QueryAnswer:
        if len(tokens) > MAX_TOKENS:
            raise ValueError(f"at most {MAX_TOKENS} token ids, got {len(tokens)}")
        identity = RequestIdentity(adapter=req.lora_name, cache_salt=req.cache_salt)

        def hashed(ns: Namespace, count: int) -> bytes:
            return prefix_chain(ns, tokens[:count], identity)

        spaces = [
            ns
            for ns in self.namespaces(req.model, req.tenant)
            if req.block_size is None or ns.block_size == req.block_size
        ]
        states = [ns for ns in spaces if LAYOUTS[ns.layout].sparse]
        answers = []
        for ns in spaces:
            if ns in states:  # answered through the pages they complete
                continue
            joined = hashed(ns, len(tokens))
            answer = self._lookup(ns, joined, req.residency)
            partners = [s for s in states if _completes(s, ns)]
            if partners and answer.blocks:
                # a hybrid state-space model's prefix ends at its last boundary state
                last = max(self._last(s, hashed(s, answer.tokens)) for s in partners)
                if last < answer.blocks:
                    answer = self._lookup(ns, joined[: HASH_BYTES * last], req.residency)
            answers.append(answer)
        return _best(req.model, self.node_id, answers)

    def _last(self, ns: Namespace, joined: bytes) -> int:
        """Blocks up to the last page stored of a sparse chain (``PageLayout.sparse``)
        whose every unit a live node holds: one more index round trip."""
        found, nodes = self._ask(ns, joined, sparse=True)
        return found.resolve(nodes, last=True).matched

    def _ask(
        self, ns: Namespace, joined: bytes, sparse: bool = False
    ) -> tuple[IndexLookup, list[NodeInfo]]:
        """The index's answer for ``joined`` with every unit of each block, and the live
        nodes, in one round trip (the node's one index connection, under its lock)."""
        units = rank_units(ns)
        with self._lock:
            # no read lease: a query (a router's, an operator's "where") reads no page, and
            # a lease would keep what it asked about from eviction for the lease's length
            found, nodes = self.index.lookup_with_nodes(
                ns, joined, units=(units.first, units.count), sparse=sparse, lease_ms=0
            )
        if isinstance(nodes, Exception):
            raise nodes
        return found, nodes

    def query_by_hash(self, req: HashQueryRequest) -> QueryAnswer:
        joined = req.joined()
        spaces = self.namespaces(req.model, req.tenant, refresh=req.namespace is not None)
        if req.namespace is not None:
            spaces = [ns for ns in spaces if ns.digest_hex == req.namespace]
        return _best(
            req.model, self.node_id, [self._lookup(ns, joined, req.residency) for ns in spaces]
        )

    def _lookup(self, ns: Namespace, joined: bytes, residency: bool = False) -> NamespaceAnswer:
        """One index round trip: the stored prefix of ``joined`` with every unit of each
        block, and the live nodes; then the answering node's tiers from its table (and,
        with ``residency``, each block of ``joined`` it holds: tier, pin, TTL)."""
        count = rank_units(ns).count
        matched = 0
        per_node: dict[str, int] = {}
        if joined:
            found, nodes = self._ask(ns, joined)
            matched = found.resolve(nodes).matched
            per_node = _blocks_per_node(found, nodes, matched, count)
        answer_nodes = [
            NodeBlocks(
                node_id=node,
                blocks=blocks,
                tiers=self._tiers(ns, joined[: HASH_BYTES * matched], count, blocks)
                if node == self.node_id
                else None,
            )
            for node, blocks in sorted(per_node.items())
        ]
        return NamespaceAnswer(
            namespace=ns.digest_hex,
            tenant=ns.tenant,
            dtype=ns.dtype,
            layout=ns.layout,
            block_size=ns.block_size,
            blocks=matched,
            tokens=matched * ns.block_size,
            nodes=answer_nodes,
            residency=self.residency(block_keys(ns, joined))
            if residency and self.residency is not None
            else None,
        )

    def _tiers(self, ns: Namespace, joined: bytes, count: int, held: int) -> dict[str, int]:
        """Blocks of the prefix whose every unit this node holds in memory ("CPU"), and
        those it holds whole with some unit only on disk ("DISK"); ``held``: the blocks
        the index says it holds whole."""
        if not self.store.namespace_pages.get(ns.digest_hex):
            return {MEDIUM_CPU: 0, MEDIUM_DISK: 0}
        if not self.store.disk_pages:
            # no page of the node is on disk: what it holds is in memory (the index
            # drops a page before the table does, so it never names a page the table lost)
            return {MEDIUM_CPU: held, MEDIUM_DISK: 0}
        chain = [joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]
        keys = unit_hashes(chain, 0, count) if count > 1 else chain
        n = len(chain)
        # one C-level pass over the table (map, not a Python loop: 8,192 blocks took 3 ms)
        found = map(self.store.pages.get, zip(repeat(ns.digest_hex), keys))
        # per page: 2 in memory, 1 only on disk, 0 not held; unit_hashes lists every
        # block's unit 0, then every block's unit 1...: one row per unit
        where = np.array(
            [
                0 if p is None else 2 if p.offset is not None else int(p.disk is not None)
                for p in found
            ],
            dtype=np.int8,
        ).reshape(count, n)
        whole = (where > 0).all(axis=0)
        in_memory = (where == 2).all(axis=0)
        return {MEDIUM_CPU: int(in_memory.sum()), MEDIUM_DISK: int((whole & ~in_memory).sum())}

    def namespaces(self, model: str | None, tenant: str, refresh: bool = False) -> list[Namespace]:
        """The registered namespaces of ``model`` (any model when None) and ``tenant``."""
        now = time.monotonic()
        reg = self._registry
        if reg is None or refresh or now - reg.read_at > REGISTRY_TTL:
            with self._lock:
                stats = self.index.stats()
            reg = self._registry = _Registry(
                now, [s.namespace for s in stats.namespaces if s.namespace is not None]
            )
        return [
            ns for ns in reg.spaces if ns.tenant == tenant and (model is None or ns.model == model)
        ]


def _blocks_per_node(
    found: IndexLookup, nodes: list[NodeInfo], matched: int, count: int
) -> dict[str, int]:
    """Blocks of the first ``matched`` whose every one of ``count`` units each live node
    holds, vectorised over the index's records (8,192 blocks: a Python loop over the
    result's locations took 45 ms here). A record counts while the registry names its
    node's incarnation, as ``IndexLookup.resolve`` counts it."""
    live = {n.number: n for n in nodes}
    node = found.records["node"].astype(np.int64)
    ok = live_records(found.records, live) & (found.positions < matched)
    out: dict[str, int] = {}
    for number in np.unique(node[ok]).tolist():
        mine = ok & (node == number)
        if count == 1:  # a position held at all is a block held whole (no sort: bincount)
            blocks = int(np.count_nonzero(np.bincount(found.positions[mine], minlength=1)))
        else:
            distinct = np.unique(found.positions[mine].astype(np.int64) * count + found.units[mine])
            blocks = int((np.bincount(distinct // count) == count).sum())
        out[live[number].node_id] = blocks
    return out


def _completes(state: Namespace, pages: Namespace) -> bool:
    """Whether the sparse namespace ``state`` holds the boundary states of the same
    engines as ``pages`` (the attention pages of one hybrid model): the same block
    size and weights (model and tenant are asked alike)."""
    return (state.block_size, state.weights) == (pages.block_size, pages.weights)


def _best(model: str | None, node_id: str, answers: list[NamespaceAnswer]) -> QueryAnswer:
    best = max(answers, key=lambda a: a.tokens, default=None)
    return QueryAnswer(
        model=model,
        tokens=best.tokens if best else 0,
        blocks=best.blocks if best else 0,
        answered_by=node_id,
        namespaces=answers,
    )


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
