"""Page layouts, one record each (kvstore.pages.layouts): a namespace's page shape, the
detection of an engine cache's layout, and PagedCache's refusal of caches it cannot page."""

from __future__ import annotations

import pytest
import torch

from client.paging.paged_cache import PagedCache
from kvstore import Namespace
from kvstore.errors import InvalidInputError, KVStoreError
from kvstore.pages.layouts import LAYOUTS, detect_layout

BLOCK, HEADS, HEAD = 16, 2, 8
LAYERS = 3

# What docs/key-format.md documents for each layout: changing one changes stored pages.
DOCUMENTED = {
    "kv_lbhd": (2, LAYERS, BLOCK, HEADS, HEAD),
    "vllm_cpu": (LAYERS, HEADS, BLOCK, 2 * HEAD),
    "vllm_flash": (LAYERS, 2, BLOCK, HEADS, HEAD),
    "vllm_mla": (LAYERS, HEADS, BLOCK, HEAD),
    "vllm_mamba_state": (LAYERS, HEADS, HEAD),  # a state's bytes do not grow with the block
    # SGLang's host pools, a page as get_page_buffer_meta names its buffers
    "sglang_2blhd": (2, BLOCK, LAYERS, HEADS, HEAD),
    "sglang_2lbhd": (2, LAYERS, BLOCK, HEADS, HEAD),
    "sglang_l2bhd": (LAYERS, 2, BLOCK, HEADS, HEAD),
    "sglang_2hbld": (2, HEADS, BLOCK, LAYERS, HEAD),
    "sglang_mla_blhd": (BLOCK, LAYERS, HEADS, HEAD),
    "sglang_mla_lbhd": (LAYERS, BLOCK, HEADS, HEAD),
    "sglang_pool_bytes": (LAYERS, HEADS, HEAD),  # a side pool's page bytes, one "layer"
}


def namespace(layout: str) -> Namespace:
    return Namespace(
        model="m",
        dtype="float16",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=HEAD,
        block_size=BLOCK,
        layout=layout,
    )


def cache_shape(layout: str, blocks: int = 7, heads: int = HEADS, head: int = HEAD) -> tuple:
    sizes = LAYOUTS[layout].sizes(layers=1, block_size=BLOCK, heads=heads, head_size=head)
    return tuple(blocks if d == "N" else sizes[d] for d in LAYOUTS[layout].cache_dims)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_namespaces_page_shape_and_axes_are_its_layouts_records(layout):
    ns = namespace(layout)
    assert ns.page_shape == DOCUMENTED[layout]
    assert ns.page_shape[ns.layer_dim] == LAYERS
    assert ns.page_shape[ns.head_dim] == HEADS


@pytest.mark.parametrize("layout", ["vllm_cpu", "vllm_flash"])
def test_an_engine_caches_layout_is_found_from_its_shape(layout):
    assert detect_layout(cache_shape(layout), BLOCK, HEADS, HEAD) == layout


def test_an_mla_cache_is_found_only_among_latent_layouts():
    latent = (7, 1, BLOCK, 576)
    assert detect_layout(latent, BLOCK, 1, 576, mla=True) == "vllm_mla"
    with pytest.raises(KVStoreError, match=r"unsupported KV cache layout \(7, 1, 16, 576\)"):
        detect_layout(latent, BLOCK, 1, 576)  # not an MLA model: no plain layout is 576 wide


@pytest.mark.parametrize(
    "shape",
    [
        cache_shape("vllm_cpu", heads=HEADS + 1),  # other heads
        cache_shape("vllm_cpu", head=HEAD * 2),  # other head size
        (7, HEADS, BLOCK * 2, 2 * HEAD),  # other block size
        (3, 7, BLOCK, HEADS, HEAD),  # 5-D, but not two halves first
    ],
)
def test_a_cache_of_no_known_layout_is_refused_naming_its_shape(shape):
    with pytest.raises(KVStoreError, match=rf"unsupported KV cache layout \({shape[0]}, "):
        detect_layout(shape, BLOCK, HEADS, HEAD)


def test_paged_cache_refuses_layouts_whose_blocks_are_not_first_and_wrong_ranks():
    with pytest.raises(InvalidInputError, match="layout vllm_flash has"):
        PagedCache([torch.zeros(cache_shape("vllm_flash"))], "vllm_flash")
    with pytest.raises(InvalidInputError, match="layout kv_lbhd has no engine cache"):
        PagedCache([torch.zeros(4, 2)], "kv_lbhd")
    with pytest.raises(
        InvalidInputError, match=r"layer 0: every layer must be a 4-D view \(vllm_mla"
    ):
        PagedCache([torch.zeros(7, 1, BLOCK)], "vllm_mla")
    cache = PagedCache([torch.zeros(cache_shape("vllm_mla"))] * 2, "vllm_mla")
    assert cache.page_shape == (2, HEADS, BLOCK, HEAD)
