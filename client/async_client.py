"""``AsyncKVCacheClient``: the store as seen by prefill and decode processes (asyncio).

Two APIs over one mechanism (publish pages, fetch a prefix of pages):
- a paged API for engines with paged caches: ``lookup`` / ``put_pages`` / ``get_pages``
  (and ``find`` / ``get_found``);
- the lookup-buffer contract of vLLM's SimpleConnector: ``insert`` / ``select``.
Beside them, the operator control calls ``pin``, ``unpin``, ``prefetch``, ``clear`` and
``where`` of the client's prefixes on every live node (``client.control``).

The client is the front of parts with one job each (``NodeDirectory``,
``NamespaceRegistration``, ``PrefixLookup``, ``Publisher``, ``PageWriter``,
``ReplicaFetcher``, ``PageReader``, ``LookupBuffer``), built and handed to one another
by ``client.parts``, which names the module of each. Every put and get is a plan run
through the handler of its (source, destination) pair (``put``, ``read``).

Remote faults (``RemoteFault``: a node that errors or times out, Redis gone, a wrong
checksum) make the affected pages count as missing, so reads return a shorter prefix
or a miss within ``timeout``. Misuse (bad shapes, dtypes, roi, options) raises
``InvalidInputError``; a put or get that every node asked refused for the client's
credentials raises ``CredentialError`` (a ``PermissionError``, ``client.nodes.credentials``).
An index that rejects a script (a bug) is logged at ERROR, counted in
``stats.index_script_errors`` and read as a miss."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from client.control import AsyncControlCalls, ClientControl
from client.gets.landing import TransferMode, lands_in_place
from client.gets.plan import (
    GetPlan,
    device_plan,
    found_plan,
    pages_plan,
    spans_plan,
    units_plan,
)
from client.gets.views import async_view
from client.lookups.prefix import Identity
from client.lookups.stored_prefix import StoredPrefix
from client.memory.device_pages import DeviceCopier, default_copier
from client.parts import client_parts
from client.puts.plan import PutPlan, keyed_put_plan, pages_put_plan
from client.puts.publish import PublishReport
from client.puts.views import async_put_view
from client.stats import ClientStats
from kvstore.pages import heads
from kvstore.pages.checksum import start_helper
from kvstore.pages.namespace import Namespace
from kvstore.settings.client import (
    ClientOptions,
    client_namespace,
    client_options,
    client_options_from_env,
    split_options,
)
from kvstore.wire.transport import ensure_ucx

__all__ = [
    "AsyncKVCacheClient",
    "Identity",
    "PublishReport",
    "StoredPrefix",
    "TransferMode",
]
R = TypeVar("R")
# Longest a client's start waits for its connections to the live nodes (the rest
# finish in the background, before or during the first request to each node).
START_CONNECT_WAIT_S = 1.0


class AsyncKVCacheClient(AsyncControlCalls):
    """One job: the client's public face (asyncio): options and namespace, start and
    close, and each call handed to the part that does it (module docstring).

    Options (``ClientOptions``: replicas, timeout, transfer_mode, auth_token, ...) come
    as keywords or as ``options=``; other keywords are ``Namespace`` fields. Without
    ``options=``, every option not passed as a keyword is read from its ``KVSTORE_*``
    variable (``ClientSettings``), else its default: a shell that exported what
    ``kvstore up`` prints (the index URL and the token file) needs no other option,
    and a missing token cannot be a silent miss (``CredentialError``)."""

    def __init__(
        self,
        redis_url: str | None = None,
        namespace: Namespace | None = None,
        *,
        options: ClientOptions | None = None,
        device: Callable[[ClientStats], DeviceCopier | None] = default_copier,
        **kwargs: Any,
    ) -> None:
        overrides, namespace_fields = split_options(kwargs)
        if redis_url is not None:
            overrides["redis_url"] = redis_url
        opts = client_options(
            options if options is not None else client_options_from_env(), **overrides
        )
        self.options = opts
        self.namespace = client_namespace(namespace, namespace_fields, opts.weights_revision)
        # pages are stored per head group, keyed by the TP-independent namespace
        # (kvstore.pages.heads): a rank reads and writes the groups its heads fall in
        self.storage = self.namespace.storage
        self.heads = heads.rank_units(self.namespace)
        self.replicas = opts.replicas
        self.timeout = opts.timeout
        parts = client_parts(opts, self.namespace, self.heads, device)
        self.stats = parts.stats
        # lands gets into device memory (client.memory.device_pages): CUDA's copier where a GPU
        # is, else none; ``device`` builds it (a test passes HostCopier)
        self.device = parts.device
        self.index, self.nodes = parts.index, parts.nodes
        self.registration, self.lookups = parts.registration, parts.lookups
        self._buffers, self._writer = parts.buffers, parts.writer
        self._reader, self._sequences = parts.reader, parts.sequences
        # pin, unpin, prefetch, clear, where (client.control: AsyncControlCalls)
        self.control = ClientControl(self.storage, self.chain_hashes, self.nodes, opts)
        # start's connections and probes (``NodeDirectory.connect``)
        self._connecting: asyncio.Future[None] | None = None

    @classmethod
    def from_env(cls, namespace: Namespace | None = None, **overrides: Any) -> AsyncKVCacheClient:
        """Build from KVSTORE_* variables (see ``ClientSettings``); keyword overrides win.
        The same as the constructor without ``options=``; kept for callers that say so."""
        return cls(None, namespace, options=client_options_from_env(), **overrides)

    @property
    def transfer_mode(self) -> TransferMode:
        return self._reader.transfer_mode

    @property
    def namespace_registered(self) -> bool:
        """Whether the namespace is registered in the index (any thread)."""
        return self.registration.registered

    @property
    def namespace_error(self) -> str | None:
        """Why the last registration of the namespace failed (any thread)."""
        return self.registration.error

    async def start(self) -> AsyncKVCacheClient:
        """Initialise UCX, fault in the process's host buffers, register the namespace,
        begin the node registry's background reads and connect to the live nodes
        (waiting at most ``START_CONNECT_WAIT_S``), so that the first request pays none
        of it. An unreachable index or node is not an error here: the client starts,
        reads miss, and the namespace is registered on the first call that reaches the
        index (an engine must not fail to boot because its cache is down)."""
        self.nodes.ucxx = ensure_ucx(self.options.ucx_progress_mode)
        # warmed here, not inside the first request (a fresh buffer costs its page faults)
        await asyncio.get_running_loop().run_in_executor(
            None, self._buffers.reserve, self.options.host_buffer_bytes
        )
        start_helper()
        await self.registration.ensure()
        self.nodes.start()
        # waited for up to a second, then left to finish in the background: a node slow
        # to answer must not hold up an engine's start for the client timeout
        self._connecting = asyncio.ensure_future(self.nodes.connect(self.timeout, self.storage.key))
        await asyncio.wait({self._connecting}, timeout=min(self.timeout, START_CONNECT_WAIT_S))
        return self

    async def __aenter__(self) -> AsyncKVCacheClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
        await self.nodes.close()
        await self.index.close()

    # ---- paged API -------------------------------------------------------------

    def chain_hashes(self, token_ids: Any, identity: Identity = None) -> bytes:
        """The storage chain hashes of ``token_ids``' full blocks, joined, under
        ``identity`` (``kvstore.pages.identity``: the adapter, salt, multimodal items and
        prompt embeddings the KV depends on; None for a plain request). Every paged and
        lookup-buffer call keys its pages with it."""
        return self.lookups.chain_hashes(token_ids, identity)

    async def lookup(self, token_ids: Any, *, identity: Identity = None) -> int:
        """Tokens of ``token_ids`` covered by stored full blocks (a multiple of block_size),
        in one index round trip. Index faults count as 0. ``identity``: what else the
        request's KV depends on (``RequestIdentity``); pages stored under another
        identity never match."""
        return await self.lookup_checked(token_ids, identity=identity) or 0

    async def lookup_checked(self, token_ids: Any, *, identity: Identity = None) -> int | None:
        """``lookup``, but None when the index could not answer at all (unreachable,
        or a script error): callers that guard the index with a circuit breaker (the
        vLLM scheduler) tell a fault from a miss with it. A shard that failed while
        others answered is a shorter prefix, not None."""
        found = await self.find(token_ids, identity=identity)
        return None if found is None else found.tokens

    async def find(
        self, token_ids: Any, *, identity: Identity = None, last: bool = False
    ) -> StoredPrefix | None:
        """``lookup_checked``, keeping what the lookup found so that ``get_found`` (in
        this client or another process's) can fetch it without a second index round
        trip. None when the index could not answer at all. ``last``: a chain stored at
        some blocks only, found up to the last (``PrefixLookup.find_steps``)."""
        lookups = self.lookups
        return await lookups.on_loop(lookups.find_steps, token_ids, identity, last=last)

    def stored_prefix(self, joined: bytes, result: Any) -> StoredPrefix:
        """What ``find`` returns for the lookup of ``joined`` that gave ``result``."""
        return self.lookups.stored_prefix(joined, result)

    # The puts: each a view of one plan (client.puts.plan: its builder holds the
    # method's signature and documentation), put by ``put``.
    put_pages = async_put_view(pages_put_plan)
    put_keyed = async_put_view(keyed_put_plan)

    async def put(self, plan: PutPlan) -> PublishReport:
        """Run a put described as a plan (``client.puts.plan``: which pages, under which
        keys, from which source), through the handler registered for its (source,
        destination) pair (``client.gets.handlers``): the public puts above build
        theirs, and a module that registers a source of its own has its plans put here.
        Returns what is stored (``PublishReport``)."""
        return await self._writer.put(plan)

    async def find_keys(
        self, page_keys: list[str], *, position: int | None = None, anchor_key: str | None = None
    ) -> StoredPrefix | None:
        """``find`` for a keyed layout (``Namespace.keyed``): the stored prefix of an
        engine's own page keys (SGLang's HiCache keys, each chained over its prefix by
        the engine), in one index round trip; None on an index fault. ``get_found_into``
        fetches it. ``position``: the chain position of the first key, when the engine
        knows it (then ``anchor_key``, the key at ``position`` rounded down to 64, where
        that differs); pages stored with positions are found with them, pages stored
        without, without (``PrefixLookup.keyed_place``)."""
        lookups = self.lookups
        place = lookups.keyed_place(position, anchor_key)
        joined = lookups.keyed_hashes(page_keys)
        return await lookups.on_loop(lookups.find_joined_steps, joined, place=place)

    # The gets: each a view of one plan (client.gets.plan: its builder holds the
    # method's signature and documentation), read by ``read``.
    get_pages = async_view(pages_plan)
    get_found = async_view(found_plan)
    get_found_device = async_view(device_plan)
    get_found_units = async_view(units_plan)
    get_found_into = async_view(spans_plan)

    async def read(self, plan: GetPlan[R]) -> R:
        """Run a get described as a plan (``client.gets.plan``: which pages, from where,
        landing where), through the handler registered for its (source, destination)
        pair (``client.gets.handlers``): the public gets above build theirs, and a
        module that registers a handler of its own has its plans read here. Returns
        what the destination's handler returns."""
        return await self._reader.read(plan)

    def lands_on_device(self, memory: torch.device) -> bool:
        """Whether ``get_found_device`` (and ``get_pages`` into a tensor there) lands
        pages straight in ``memory``; else gets into it stage through host memory."""
        return self._reader.lands_on_device(memory)

    def lands_layers(self, memory: torch.device) -> bool:
        """Whether ``get_found_device`` into ``memory`` can land layer by layer (a feed)."""
        return self._reader.lands_layers(memory)

    def units_nbytes(self, blocks: int) -> int:
        """Bytes of this rank's head-group units of ``blocks`` blocks."""
        return self._reader.units_nbytes(blocks)

    # ---- lookup-buffer API (client.sequences) ------------------------------------

    async def insert(
        self,
        input_tokens: Any,
        roi: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor | None = None,
        *,
        identity: Identity = None,
    ) -> PublishReport:
        """Store the KV of the tokens ``roi`` marks (a prefix of ``input_tokens``).

        Full blocks become shared, deduplicated pages; the trailing partial block and
        ``hidden`` go into the sequence's tail object. ``identity``: what else the KV
        depends on (adapter, salt, multimodal items, prompt embeddings); a ``select``
        under another identity never finds it."""
        return await self._sequences.insert(
            input_tokens, roi, key, value, hidden, identity=identity
        )

    async def select(self, input_tokens: Any, roi: Any, *, identity: Identity = None) -> list[Any]:
        """``[input_tokens, roi, key, value, hidden]`` for the longest stored prefix of the
        tokens ``roi`` marks: everything plus ``hidden`` when this exact sequence was
        inserted, else the longest block-aligned prefix with ``hidden=None``; five
        ``None`` on a miss. The returned ``roi`` marks the matched tokens; key and value
        are contiguous. ``identity``: the one the sequence was inserted under."""
        return await self._sequences.select(input_tokens, roi, identity=identity)

    def _mode_for(self, out: torch.Tensor) -> str:
        """How a get into ``out`` lands whole pages: "direct" (in place) or "staged"
        (``client.gets.landing.lands_in_place``; raises for 'direct' into device memory)."""
        return "direct" if lands_in_place(out.device.type, self.transfer_mode) else "staged"
