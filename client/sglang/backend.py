"""``KVStoreHiCache``: kvstore as an L3 storage backend of SGLang's hierarchical cache
(HiCache), loaded by SGLang's ``dynamic`` backend (docs/sglang.md):

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvstore", "module_path": "client.sglang", "class_name": "KVStoreHiCache", "interface_v1": 1}'

SGLang's scheduler threads call it: its prefetch thread asks ``batch_exists`` and
``batch_get_v1``, its backup thread ``batch_set_v1``, with SGLang's chained SHA-256
page hashes as keys (batches of 128 from its cache controller; a hybrid controller asks
``batch_exists`` for a whole prompt at once). A key maps to a kvstore page hash inside
a namespace built from the model, the rank and the host layout (``PoolPages``), each
key a one-page index segment of its own (``client.sglang.pool_calls.PoolCalls.find``
says why); a lookup is the index's one round trip; a get lands each page straight in
the host pool's slots (copied from the node's memory on the same host, over UCX
otherwise); a put sends from them. A hybrid model's side pools (Mamba states, sliding-window KV),
registered with ``register_mem_host_pool_v2``, are pages of namespaces of their own,
moved the same way by SGLang's v2 calls; ``batch_exists_v2`` applies each pool's hit
policy (``restorable_ends``) to which of its pages are stored.

Nothing raises into SGLang's data path: a fault (an index or node that cannot be
reached, a timeout, a refused credential) is a miss, a False or a shorter prefix,
counted in ``failures`` by kind and logged at most once a minute (``PoolCalls``).
Bad configuration raises when SGLang builds the backend or registers its pool: the
attach fails, with a line naming what was wrong."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from client.log_limit import LogLimit
from client.memory.buffers import Span, host_bytes
from client.sglang.options import hicache_options
from client.sglang.pool_calls import NOT_REGISTERED, Pool, PoolCalls
from client.sglang.pool_pages import PoolPages
from client.sglang.restorable import SERVED_POLICIES, restorable_ends
from client.sglang.store import KeyedStore, KeyedStoreOpener, client_stores
from kvstore.errors import InvalidInputError

log = logging.getLogger(__name__)


KV = PoolName.KV.value


def _pool_name(value: Any) -> str:
    """A pool name or hit policy as its string, whether SGLang passed its enum or a str
    (``str()`` gives ``PoolHitPolicy.ALL_PAGES`` for its hit policies; its pool names'
    ``str()`` is their value)."""
    return str(getattr(value, "value", value))


# SGLang's pools whose transfers use the block_groups hit policy (DeepSeek V4's
# compressed blocks), which this backend does not serve: refused at registration.
UNSERVED_POOLS = "deepseek_v4_"


class KVStoreHiCache(HiCacheStorage):
    """One job: SGLang's ``HiCacheStorage`` over a store per registered pool. Built by
    SGLang as ``KVStoreHiCache(storage_config, kwargs)`` (a ``KVCacheClient`` each);
    ``stores``: a caller's opener instead (``client.sglang.store``). Usable once SGLang
    registers its host pool (``register_mem_pool_host``), which opens the store."""

    def __init__(
        self, storage_config: Any, kwargs: Any = None, *, stores: KeyedStoreOpener | None = None
    ) -> None:
        self.storage_config = storage_config
        self._options, client_options = hicache_options(storage_config.extra_config)
        self._open = stores if stores is not None else client_stores(client_options)
        self._pools: dict[str, Pool] = {}  # by SGLang's pool name; "kv" once registered
        self._limit = LogLimit(log)
        self._calls = PoolCalls(self._limit)  # index and node calls: a fault is a miss
        self.failures = self._calls.failures  # by kind: "lookup", "get", "set"
        pool = kwargs if kwargs is not None and hasattr(kwargs, "kv_buffer") else None
        if pool is not None:  # built the way SGLang builds its own backends: (config, pool)
            self.register_mem_pool_host(pool)

    # ---- set-up ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool: its pages' namespace and spans, and their store (raises
        ``InvalidInputError`` for a pool or rank it does not serve, failing the attach)."""
        super().register_mem_pool_host(mem_pool_host)
        pages = PoolPages.of(mem_pool_host, self.storage_config, self._options)
        self._attach(KV, pages, pages.namespace.stores_heads)
        log.info(
            "kvstore HiCache backend: %s pages of %d bytes (%s), tenant %s, rank %d of %d%s",
            pages.namespace.layout,
            pages.namespace.page_nbytes,
            mem_pool_host.layout,
            pages.namespace.tenant,
            pages.namespace.tp_rank,
            pages.namespace.tp_size,
            ""
            if self._pools[KV].writes
            else " (reads only: rank 0 writes the shared latent pages)",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's further pools: the KV pool again (registered already), or a hybrid
        model's side pool (Mamba states, sliding-window KV), whose pages become a
        namespace of their own (``PoolPages.side``); a pool whose pages cannot be named
        as spans over its host memory is refused, failing the attach with that line
        instead of a cache that misses."""
        name = _pool_name(host_pool_name)
        if name.startswith(UNSERVED_POOLS):
            raise InvalidInputError(
                f"the kvstore HiCache backend does not serve SGLang's {name} pool "
                "(DeepSeek V4's compressed blocks: the block_groups hit policy)"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if name == KV:
            return
        if KV not in self._pools:
            raise InvalidInputError(
                f"SGLang registered its {name} pool before the KV pool (register_mem_pool_host)"
            )
        pages = PoolPages.side(host_pool, name, self.pages.namespace)
        self._attach(name, pages, pages.namespace.stores_heads)
        log.info(
            "kvstore HiCache backend: side pool %s, pages of %d bytes per %d tokens",
            name,
            pages.namespace.page_nbytes,
            host_pool.page_size,
        )

    def _attach(self, name: str, pages: PoolPages, writes: bool) -> None:
        old = self._pools.pop(name, None)
        if old is not None:
            old.client.close()
        self._pools[name] = Pool(pages, self._open(pages.namespace), writes)

    @property
    def client(self) -> KeyedStore:
        """The KV pool's store (raises until SGLang registered the host pool)."""
        return self._kv.client

    @property
    def pages(self) -> PoolPages:
        """The KV pool's pages (raises until SGLang registered the host pool)."""
        return self._kv.pages

    @property
    def _kv(self) -> Pool:
        pool = self._pools.get(KV)
        if pool is None:
            raise InvalidInputError(NOT_REGISTERED)
        return pool

    def close(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.client.close()

    # ---- the zero-copy path (interface_v1) ---------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Pages of ``keys`` stored from the first on, in one index round trip; 0 on a
        fault."""
        found = self._calls.find(self._pools.get(KV), keys, lease=False)  # nothing is fetched
        return found.blocks if found is not None else 0

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """The stored prefix of ``keys`` into the host pool's slots ``host_indices``
        (a page's worth per key): True for each page that arrived, checked, from the
        first on; False from the first that did not (a fault: all False)."""
        return self._get(self._pools.get(KV), keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages ``host_indices`` under ``keys`` (pages a node
        holds already are not sent again): all True when every page is stored, all False
        otherwise. A rank that does not write (MLA's latent, written by rank 0) stores
        nothing and says True."""
        return self._set(self._pools.get(KV), keys, host_indices)

    def _get(self, pool: Pool | None, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        found = self._calls.find(pool, keys)
        got = 0
        if pool is not None and found is not None and found.blocks:
            size = pool.pages.pool.page_size
            got = self._calls.land(
                pool, found, lambda: pool.pages.spans(host_indices[: found.blocks * size])
            )
        return [i < got for i in range(len(keys))]

    def _set(self, pool: Pool | None, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if pool is None:
            self._calls.failed("set", NOT_REGISTERED)
            return [False] * len(keys)
        if not keys or not pool.writes:
            return [True] * len(keys)
        try:
            spans = pool.pages.spans(host_indices[: len(keys) * pool.pages.pool.page_size])
            report = pool.client.put_keyed(keys, spans)
        except Exception as exc:
            self._calls.failed("set", exc)
            return [False] * len(keys)
        if report.stored < len(keys):
            self._calls.failed(
                "set", f"{len(keys) - report.stored} of {len(keys)} pages not stored"
            )
            return [False] * len(keys)
        return [True] * len(keys)

    # ---- v2 (SGLang's per-pool calls: hybrid models' side pools) -------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The KV pages of ``keys`` stored from the first on (``batch_exists``), cut
        to what every side pool of ``pool_transfers`` can restore: each pool's pages
        are asked position by position in one index round trip (``stored_keys``), and
        its hit policy says which prefix lengths they serve (``restorable_ends``). The
        answer holds the longest length every pool serves, each pool's own boundary,
        and every such length (SGLang intersects them over TP ranks). A pool not
        registered, or a fault, serves none."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or ():
            name = _pool_name(transfer.name)
            if name == KV or not restorable:
                continue
            policy = _pool_name(transfer.hit_policy)
            if policy in SERVED_POLICIES:
                present = self._calls.stored(self._pools.get(name), name, keys[:kv_pages])
            else:  # it restores no length: no prefix is usable
                self._calls.failed("lookup", f"the {name} pool's hit policy {policy} is not served")
                present = []
            served = restorable_ends(present, policy, max(1, len(transfer.keys or ())))
            if served:
                hits[transfer.name] = max(served)
            restorable &= set(served)
        ends = sorted(restorable)
        return PoolTransferResult(ends[-1] if ends else 0, hits, ends)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Each transfer's pages (``keys``) into its pool's slots ``host_indices``, as
        ``batch_get_v1``: per pool name, True for each page that arrived."""
        return self._each_v2(transfers, self._get, "get")

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Each transfer's pages from its pool's slots under its keys, as
        ``batch_set_v1``: per pool name, all True when every page is stored."""
        return self._each_v2(transfers, self._set, "set")

    def _each_v2(
        self,
        transfers: list[PoolTransfer],
        call: Callable[[Pool, list[str], Any], list[bool]],
        kind: str,
    ) -> dict[str, list[bool]]:
        """``call`` for each transfer's pool, keys and slots; all False for a pool
        never registered or a transfer without slots (counted as ``kind``)."""
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name, keys = _pool_name(t.name), list(t.keys or ())
            pool = self._pools.get(name)
            if pool is None or t.host_indices is None:
                if keys:
                    self._calls.failed(
                        kind, f"a transfer of the {name} pool without a pool or slots"
                    )
                out[name] = [False] * len(keys)
            else:
                out[name] = call(pool, keys, t.host_indices)
        return out

    # ---- the copying path (SGLang without interface_v1) ----------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location])
        return got[0] if isinstance(got, list) else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Each key's page into its flat page tensor (SGLang's ``get_dummy_flat_data_page``),
        None from the first page that did not arrive."""
        if not keys:
            return []
        found = self._calls.find(self._pools.get(KV), keys)
        got = 0
        if found is not None and found.blocks:
            try:
                targets = list(target_locations[: found.blocks])
                pages = [self._page_order(t, landing=True) for t in targets]
                sinks = [self._flat_span(p) for p in pages]
                got = self.client.get_found_into(found, sinks) // self.pages.namespace.block_size
                for target, page in zip(targets[:got], pages[:got], strict=True):
                    if page is not target:
                        target.view(-1).copy_(self._flat_order(page))
            except Exception as exc:
                self._calls.failed("get", exc)
        return [target_locations[i] if i < got else None for i in range(len(keys))]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store each flat page tensor (SGLang's ``get_data_page``) under its key."""
        pool = self._pools.get(KV)
        if pool is None:
            self._calls.failed("set", NOT_REGISTERED)
            return False
        if not keys or not pool.writes:
            return True
        try:
            spans = [self._flat_span(self._page_order(v)) for v in values]
            report = self.client.put_keyed(keys, spans)
        except Exception as exc:
            self._calls.failed("set", exc)
            return False
        return report.stored == len(keys)

    def _page_order(self, flat: torch.Tensor, landing: bool = False) -> torch.Tensor:
        """A flat data page (SGLang's ``get_data_page`` order) in the page's byte order:
        the same tensor for every layout but MHA's layer_first, whose flat page holds
        every layer's K before any V and whose page holds each layer's K and V together
        (``landing``: an empty page to land in and copy back with ``_flat_order``)."""
        if self.pages.namespace.layout != "sglang_l2bhd":
            return flat
        if landing:
            return torch.empty_like(flat)
        return flat.reshape(2, self.pages.namespace.num_layers, -1).transpose(0, 1).contiguous()

    def _flat_order(self, page: torch.Tensor) -> torch.Tensor:
        """``_page_order`` undone: a layer_first page in SGLang's flat order."""
        return page.reshape(self.pages.namespace.num_layers, 2, -1).transpose(0, 1).reshape(-1)

    def _flat_span(self, page: torch.Tensor) -> Span:
        flat = host_bytes(page.contiguous())
        if flat.nbytes != self.pages.namespace.page_nbytes:
            raise InvalidInputError(
                f"a flat page of {flat.nbytes} bytes; a page here is {self.pages.namespace.page_nbytes}"
            )
        return Span(flat, 0, flat.nbytes)

    # ---- not served -----------------------------------------------------------------

    def clear(self) -> None:
        """Not done: a client cannot empty the store; pages leave by eviction."""
        self._limit.warning("clear", "kvstore HiCache: clear is not supported; pages stay")

    def get_stats(self) -> Any:
        return None
