"""``KVStoreHiCache``: kvstore as an L3 storage backend of SGLang's hierarchical cache
(HiCache), loaded by SGLang's ``dynamic`` backend (docs/sglang.md):

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvstore", "module_path": "client.sglang", "class_name": "KVStoreHiCache", "interface_v1": 1}'

SGLang's scheduler threads call it: its prefetch thread asks ``batch_exists`` and
``batch_get_v1``, its backup thread ``batch_set_v1``, with SGLang's chained SHA-256
page hashes as keys (batches of 128 from its cache controller; a hybrid controller asks
``batch_exists`` for a whole prompt at once). A key maps to a kvstore page hash inside
a namespace built from the model, the rank and the host layout (``PoolPages``), each
key a one-page index segment of its own (``_find`` says why); a lookup is the index's
one round trip; a get lands each page straight in the host
pool's slots (copied from the node's memory on the same host, over UCX otherwise); a
put sends from them.

Nothing raises into SGLang's data path: a fault (an index or node that cannot be
reached, a timeout, a refused credential) is a miss, a False or a shorter prefix,
counted in ``failures`` by kind and logged at most once a minute. Bad configuration
raises when SGLang builds the backend or registers its pool: the attach fails, with a
line naming what was wrong."""

from __future__ import annotations

import logging
from collections import Counter
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
from client.sglang.pool_pages import PoolPages
from client.sync_client import KVCacheClient
from kvstore.errors import InvalidInputError

log = logging.getLogger(__name__)


class KVStoreHiCache(HiCacheStorage):
    """One job: SGLang's ``HiCacheStorage`` over a ``KVCacheClient``. Built by SGLang
    as ``KVStoreHiCache(storage_config, kwargs)``; usable once SGLang registers its host
    pool (``register_mem_pool_host``), which makes the client."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self._options, self._client_options = hicache_options(storage_config.extra_config)
        self._pages: PoolPages | None = None
        self._client: KVCacheClient | None = None
        self._writes = True
        self.failures: Counter[str] = Counter()
        self._limit = LogLimit(log)
        pool = kwargs if kwargs is not None and hasattr(kwargs, "kv_buffer") else None
        if pool is not None:  # built the way SGLang builds its own backends: (config, pool)
            self.register_mem_pool_host(pool)

    # ---- set-up ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool: its pages' namespace and spans, and the client (raises
        ``InvalidInputError`` for a pool or rank it does not serve, failing the attach)."""
        super().register_mem_pool_host(mem_pool_host)
        pages = PoolPages.of(mem_pool_host, self.storage_config, self._options)
        if self._client is not None:
            self._client.close()
        self._client = KVCacheClient(None, pages.namespace, options=self._client_options)
        self._pages = pages
        self._writes = pages.namespace.stores_heads
        log.info(
            "kvstore HiCache backend: %s pages of %d bytes (%s), tenant %s, rank %d of %d%s",
            pages.namespace.layout,
            pages.namespace.page_nbytes,
            mem_pool_host.layout,
            pages.namespace.tenant,
            pages.namespace.tp_rank,
            pages.namespace.tp_size,
            "" if self._writes else " (reads only: rank 0 writes the shared latent pages)",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's further pools: the KV pool again (already registered), or a hybrid
        model's (Mamba, sliding-window, indexer, draft), which this backend does not
        store: refused, so the attach fails with that line instead of a cache that
        misses."""
        if str(host_pool_name) != PoolName.KV.value:
            raise InvalidInputError(
                f"the kvstore HiCache backend stores KV pools only, not SGLang's "
                f"{host_pool_name!s} pool (hybrid models: docs/sglang.md)"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    @property
    def client(self) -> KVCacheClient:
        """The client (raises until SGLang registered the host pool)."""
        if self._client is None:
            raise InvalidInputError("SGLang has not registered its host pool with the backend")
        return self._client

    @property
    def pages(self) -> PoolPages:
        if self._pages is None:
            raise InvalidInputError("SGLang has not registered its host pool with the backend")
        return self._pages

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ---- the zero-copy path (interface_v1) ---------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Pages of ``keys`` stored from the first on, in one index round trip; 0 on a
        fault."""
        found = self._find(keys, lease=False)  # nothing is fetched from this answer
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
        if not keys:
            return []
        found = self._find(keys)
        got = 0
        if found is not None and found.blocks:
            size = self.pages.pool.page_size
            got = self._land(found, lambda: self.pages.spans(host_indices[: found.blocks * size]))
        return [i < got for i in range(len(keys))]

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
        if not keys or not self._writes:
            return [True] * len(keys)
        try:
            spans = self.pages.spans(host_indices)
            report = self.client.put_keyed(keys, spans)
        except Exception as exc:
            self._failed("set", exc)
            return [False] * len(keys)
        if report.stored < len(keys):
            self._failed("set", f"{len(keys) - report.stored} of {len(keys)} pages not stored")
            return [False] * len(keys)
        return [True] * len(keys)

    # ---- v2 (SGLang's per-pool calls): the KV pool through the v1 path ------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """``batch_exists``; a transfer of a pool other than KV is a miss (never
        registered: ``register_mem_host_pool_v2``)."""
        if any(str(t.name) != PoolName.KV.value for t in pool_transfers or ()):
            return PoolTransferResult(0, {})
        return PoolTransferResult(self.batch_exists(keys, extra_info), {})

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return self._each_v2(transfers, self.batch_get_v1, extra_info)

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return self._each_v2(transfers, self.batch_set_v1, extra_info)

    def _each_v2(
        self, transfers: list[PoolTransfer], call: Any, extra_info: Any
    ) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = t.keys or []
            kv = str(t.name) == PoolName.KV.value and t.host_indices is not None
            out[str(t.name)] = call(keys, t.host_indices, extra_info) if kv else [False] * len(keys)
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
        found = self._find(keys)
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
                self._failed("get", exc)
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
        if not keys or not self._writes:
            return True
        try:
            spans = [self._flat_span(self._page_order(v)) for v in values]
            report = self.client.put_keyed(keys, spans)
        except Exception as exc:
            self._failed("set", exc)
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

    # ---- faults --------------------------------------------------------------------

    def _land(self, found: Any, sinks: Any) -> int:
        """Pages of ``found`` landed in the spans ``sinks()`` makes, from the first on;
        one that was found but did not arrive (a node gone, a page evicted or failing
        its check) is counted and logged, as any fault on the way (0 then)."""
        try:
            got = self.client.get_found_into(found, sinks()) // self.pages.namespace.block_size
        except Exception as exc:  # a fault is a miss, never SGLang's exception
            self._failed("get", exc)
            return 0
        if got < found.blocks:
            self._failed(
                "get", f"{found.blocks - got} of {found.blocks} pages found did not arrive"
            )
        return got

    def _find(self, keys: list[str], *, lease: bool = True) -> Any:
        """The client's ``find_keys``, or None on any fault (counted, logged). Keys go
        without chain positions: SGLang 0.5.23's ``prefix_keys`` are not the keys
        before a prefetch's batch (its scheduler passes the ancestors of the node the
        host cache ended in, without that node's own keys), so positions read from them
        would place a prefetch's lookups where its backups never put the pages."""
        if not keys:
            return None
        try:
            found = self.client.find_keys(keys, lease=lease)
        except Exception as exc:
            self._failed("lookup", exc)
            return None
        if found is None:
            self._failed("lookup", "the index did not answer")
        return found

    def _failed(self, kind: str, why: object) -> None:
        self.failures[kind] += 1
        self._limit.warning(
            kind, "kvstore HiCache %s failed, counted as a miss or False: %s", kind, why
        )

    def clear(self) -> None:
        """Not done: a client cannot empty the store; pages leave by eviction."""
        self._limit.warning("clear", "kvstore HiCache: clear is not supported; pages stay")

    def get_stats(self) -> Any:
        return None
