"""What the SGLang checks (tests/support/sglang_checks.py, sglang_hybrid_checks.py)
share: SGLang's storage config and backend as SGLang attaches them, its page keys, and
host pools filled and compared page by page. Imported in the checks' child process
only (it imports SGLang)."""

from __future__ import annotations

import random
from typing import Any

from tests.support.sglang_site import define_torchvision_ops

define_torchvision_ops()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

PAGE = 4  # tokens per page of every pool here


def config(redis_url: str, *, mla: bool = False, rank: int = 0, size: int = 1, **extra: Any) -> Any:
    """SGLang's storage config of one rank, with the extra config README gives."""
    extra_config = {
        "backend_name": "kvstore",
        "module_path": "client.sglang",
        "class_name": "KVStoreHiCache",
        "interface_v1": 1,
        "redis_url": redis_url,
        **extra,
    }
    return HiCacheStorageConfig(
        tp_rank=rank,
        tp_size=size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=extra_config.pop("attn_cp_size", 1),
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=extra_config.pop("model_name", "tiny/llama"),
        extra_config=extra_config,
    )


def backend(cfg: Any, pool: Any) -> Any:
    """The backend as SGLang attaches it: built by its factory (``dynamic``), then
    handed the host pool."""
    made = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    made.register_mem_pool_host(pool)
    made.on_host_pools_registered()
    return made


def page_keys(seed: int, pages: int, salt: str | None = None) -> list[str]:
    """SGLang's storage keys of a random prompt of ``pages`` pages (its own hash)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(32000) for _ in range(pages * PAGE)]
    prior = get_storage_hash_str([], None) if salt is None else None
    keys = get_storage_hash_str(tokens, prior, page_size=PAGE)
    return keys if salt is None else [f"{salt}-{k}" for k in keys]


def fill(pool: Any, pages: int, seed: int) -> torch.Tensor:
    """``pages`` pages' slots of ``pool``, filled with random bytes."""
    slots = pool.alloc(pages * PAGE)
    gen = torch.Generator().manual_seed(seed)
    for i in range(pages):
        page = pool.get_data_page(int(slots[i * PAGE]), flat=False)
        page.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, page.shape, generator=gen))
    return slots


def page_bytes(pool: Any, slots: torch.Tensor, i: int) -> bytes:
    return pool.get_data_page(int(slots[i * PAGE])).view(torch.uint8).numpy().tobytes()


def same_pages(pool: Any, a: torch.Tensor, b: torch.Tensor, count: int, other: Any = None) -> bool:
    return all(page_bytes(pool, a, i) == page_bytes(other or pool, b, i) for i in range(count))


def state_bytes(pool: Any, slot: int) -> bytes:
    """A Mamba pool slot's state, as SGLang's flat page of it (SSM state, then each conv)."""
    return pool.get_data_page(slot).view(torch.uint8).numpy().tobytes()


def refused(make: Any) -> str:
    try:
        make()
    except Exception as exc:  # the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "accepted"
