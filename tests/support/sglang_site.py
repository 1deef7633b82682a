"""SGLang for the test_sglang* files: where its wheel lies (``SGLANG_SITE``: the folder
``.ci/run`` installs it into without its dependencies, or ``KVSTORE_SGLANG_SITE``), the
environment a child process imports it with (``sglang_env``), and, in that child, its
real host pools built on the CPU (``make_host_pool``).

SGLang runs HiCache on CUDA, HIP and XPU only, and its wheel pins a CUDA stack, so no
SGLang server runs here: its storage classes do, in a child process, importing SGLang
as it lies. One thing is mended for that: SGLang's config package imports
``torchvision.transforms`` (image constants of its vision models), and PyPI's
torchvision links CUDA torch, so its kernels cannot load beside the CPU torch and its
import fails registering fake kernels for two of its ops. ``define_torchvision_ops``
declares those two ops' schemas first (no kernels: nothing here calls them), which is
all torchvision's Python needs to import."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import ROOT

SGLANG_SITE = Path(os.environ.get("KVSTORE_SGLANG_SITE", ROOT / ".venv" / "sglang-site"))
TRITON_SITE = ROOT / ".venv" / "triton-site"
HAS_SGLANG = (SGLANG_SITE / "sglang" / "srt" / "mem_cache" / "hicache_storage.py").is_file()
skip_without_sglang = pytest.mark.skipif(
    not HAS_SGLANG,
    reason=f"SGLang is not installed in {SGLANG_SITE} (.ci/run's line installs it)",
)


def sglang_env() -> dict[str, str]:
    """The environment of a child process that imports SGLang (and this checkout)."""
    path = [str(ROOT), str(SGLANG_SITE), str(TRITON_SITE)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "UCX_NET_DEVICES": "lo"}


def define_torchvision_ops() -> None:
    """Declare the schemas of the torchvision ops whose fake kernels its import
    registers (module docstring); a child calls it before importing SGLang, once or
    from each module that imports SGLang (a second call does nothing: torch refuses a
    namespace defined twice)."""
    if _KEEP:
        return
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)


_KEEP: list[Any] = []


def make_host_pool(
    layout: str,
    *,
    mla: bool = False,
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 8,
    page_size: int = 4,
    pages: int = 32,
    dtype: Any = None,
    device_pages: int | None = None,
) -> Any:
    """SGLang's own host pool (``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``) in
    host ``layout``, on the CPU, unpinned (pinning needs CUDA), sized for ``pages``
    pages, built from SGLang's device pool of the same geometry on the CPU as SGLang
    builds it (``device_pages`` pages of it: ``pages`` when None). For MLA, ``heads``
    is ignored and the latent is ``head_dim`` * 2 wide plus 8 rope dimensions."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    tokens = pages * page_size
    on_device = (device_pages or pages) * page_size
    last = layers - 1
    if mla:
        device = MLATokenToKVPool(
            on_device, page_size, dtype, 2 * head_dim, 8, layers, "cpu", False,
            start_layer=0, end_layer=last,
        )  # fmt: skip
    else:
        device = MHATokenToKVPool(
            on_device, page_size, dtype, heads, head_dim, layers, "cpu", False,
            start_layer=0, end_layer=last,
        )  # fmt: skip
    info = device.get_device_pool_infos()[0].buffer_info
    common = {
        "pin_memory": False,
        "device": "cpu",
        "device_capacity_tokens": device.size,
        "start_layer": device.start_layer,
        "end_layer": device.end_layer,
        "host_token_capacity": tokens,
    }
    # a budget of our own (the machine's memory): SGLang otherwise samples free memory
    # and keeps 10 GiB of it back, more than a test machine may have free
    with host_memory_budget_scope(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")):
        if mla:
            pool = MLATokenToKVPoolHost(
                info, 1.0, 0, page_size, layout,
                override_kv_cache_dim=device.kv_cache_dim, target_layer_num=device.layer_num,
                **common,
            )  # fmt: skip
        else:
            pool = MHATokenToKVPoolHost(
                info, 1.0, 0, page_size, layout,
                write_back_staging=device.hicache_write_back_staging, **common,
            )  # fmt: skip
    pool.device_pool_for_test = device  # the device tensors the pool's info points at
    return pool


def make_mamba_pool(*, layers: int = 2, slots: int = 16, side_state: bool = False) -> Any:
    """SGLang's own Mamba host pool (``MambaPoolHost``, layout page_first, unpinned) on
    the CPU for a hybrid model of ``layers`` Mamba layers: a float32 SSM state and two
    bfloat16 conv states per layer and slot, ``slots`` slots of device pool behind
    ``slots`` host slots. ``side_state``: the slots carry a side state of their own
    (SGLang's ``extra_checkpoint_buffers``), whose pages its zero-copy path refuses."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 2, 4, 8, dtype=torch.float32),
        conv=(
            torch.zeros(layers, slots, 6, 3, dtype=torch.bfloat16),
            torch.zeros(layers, slots, 4, 3, dtype=torch.bfloat16),
        ),
        extra_checkpoint_buffers=(torch.zeros(slots, 5),) if side_state else (),
    )
    with host_memory_budget_scope(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")):
        return MambaPoolHost(
            info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
            layout="page_first",
        )  # fmt: skip
