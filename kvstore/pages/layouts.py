"""Page layouts, one record each (``PageLayout``): how a page holds one block of every
layer of a pipeline stage, and which per-layer tensor of an engine's paged KV cache
holds that layout's blocks.

A namespace names its layout (``Namespace.layout``, part of its digest: pages of two
layouts never match), the namespace's page shape comes from the record's ``page_dims``,
and a connector finds the layout of the caches an engine registers with
``detect_layout``. Adding a layout (a GPU backend's byte order) is one record here and
its tests; the names and dimensions of the existing ones are part of the hash format
(golden vectors) and never change."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import KVStoreError

# The letters of a layout's dimensions: 2 (K and V), L (layers), B (the block's tokens),
# H (KV heads), D (head size), KV (2 * head size as one dimension) and, in an engine's
# per-layer cache, N (its blocks).


@dataclass(frozen=True)
class PageLayout:
    """One page layout.

    ``page_dims``: a page's dimensions, in order. ``cache_dims``: the dimensions of an
    engine's per-layer cache tensor whose blocks have this layout, or () where no
    engine's cache does (``kv_lbhd``, the insert/select API's own). ``latent``: an MLA
    layout, whose "head" is one latent row per token (``head_size`` is the latent
    width, and there is one head on every TP rank). ``sparse``: a chain of this layout
    holds pages at some blocks only, each standing for the prefix up to it (a hybrid
    model's boundary states, found up to the last one stored); a prefix of the same
    model's attention pages is usable up to such a page only. ``keyed``: the pages
    are keyed by an engine's own page keys (SGLang's HiCache: each key chained over the
    prefix already), not by token ids (``kvstore.pages.hashing.keyed_hash_bytes``)."""

    name: str
    page_dims: tuple[str, ...]
    cache_dims: tuple[str, ...] = ()
    latent: bool = False
    description: str = ""
    sparse: bool = False
    keyed: bool = False

    def sizes(self, *, layers: int, block_size: int, heads: int, head_size: int) -> dict[str, int]:
        return {
            "2": 2,
            "L": layers,
            "B": block_size,
            "H": heads,
            "D": head_size,
            "KV": 2 * head_size,
        }

    def page_shape(
        self, *, layers: int, block_size: int, heads: int, head_size: int
    ) -> tuple[int, ...]:
        """A page's shape for these sizes."""
        sizes = self.sizes(layers=layers, block_size=block_size, heads=heads, head_size=head_size)
        return tuple(sizes[d] for d in self.page_dims)

    def axis(self, dim: str) -> int:
        """The index of ``dim`` (a letter above) in a page."""
        return self.page_dims.index(dim)

    @property
    def block_axis(self) -> int:
        """The index of the blocks' dimension in the engine's per-layer cache tensor."""
        return self.cache_dims.index("N")

    def holds(self, shape: tuple[int, ...], *, block_size: int, heads: int, head_size: int) -> bool:
        """Whether a per-layer cache tensor of ``shape`` holds this layout's blocks (any
        number of them)."""
        if not self.cache_dims or len(shape) != len(self.cache_dims):
            return False
        sizes = self.sizes(layers=1, block_size=block_size, heads=heads, head_size=head_size)
        return all(d == "N" or sizes[d] == n for d, n in zip(self.cache_dims, shape, strict=True))


LAYOUTS: dict[str, PageLayout] = {
    layout.name: layout
    for layout in (
        PageLayout(
            "kv_lbhd",
            ("2", "L", "B", "H", "D"),
            description="[2, layers, block_size, kv_heads, head_size] (insert/select API)",
        ),
        PageLayout(
            "vllm_cpu",
            ("L", "H", "B", "KV"),
            ("N", "H", "B", "KV"),
            description="[layers, kv_heads, block_size, 2 * head_size]: vLLM's CPU attention "
            "backend, and 0.32's connector view on every backend",
        ),
        PageLayout(
            "vllm_flash",
            ("L", "2", "B", "H", "D"),
            ("2", "N", "B", "H", "D"),
            description="[layers, 2, block_size, kv_heads, head_size]: vLLM's FlashAttention "
            "backend",
        ),
        PageLayout(
            "vllm_mla",
            ("L", "H", "B", "D"),
            ("N", "H", "B", "D"),
            latent=True,
            description="[layers, 1, block_size, latent]: vLLM MLA, one latent row of "
            "kv_lora_rank + rope dims per token, the same on every TP rank",
        ),
        PageLayout(
            "vllm_mamba_state",
            ("L", "H", "D"),
            description="[state layers, TP shares, state bytes]: the state of a hybrid "
            "model's Mamba or linear-attention layers after a block boundary (int8, each "
            "layer's state tensors back to back as vLLM keeps them in a block), stored as "
            "the last block of that prefix only (client.vllm.states)",
            sparse=True,
        ),
        # SGLang HiCache host pools (client.sglang): a page is what the pool's
        # get_page_buffer_meta names for it, its buffers back to back.
        PageLayout(
            "sglang_2blhd",
            ("2", "B", "L", "H", "D"),
            description="[2, page_size, layers, kv_heads, head_dim]: SGLang's MHA host pool, "
            "layout page_first (K of the page, then V)",
            keyed=True,
        ),
        PageLayout(
            "sglang_2lbhd",
            ("2", "L", "B", "H", "D"),
            description="[2, layers, page_size, kv_heads, head_dim]: SGLang's MHA host pool, "
            "layout page_first_direct",
            keyed=True,
        ),
        PageLayout(
            "sglang_l2bhd",
            ("L", "2", "B", "H", "D"),
            description="[layers, 2, page_size, kv_heads, head_dim]: SGLang's MHA host pool, "
            "layout layer_first (each layer's K, then its V)",
            keyed=True,
        ),
        PageLayout(
            "sglang_2hbld",
            ("2", "H", "B", "L", "D"),
            description="[2, kv_heads, page_size, layers, head_dim]: SGLang's MHA host pool, "
            "layout page_head",
            keyed=True,
        ),
        PageLayout(
            "sglang_mla_blhd",
            ("B", "L", "H", "D"),
            latent=True,
            description="[page_size, layers, 1, kv_cache_dim]: SGLang's MLA host pool, layout "
            "page_first",
            keyed=True,
        ),
        PageLayout(
            "sglang_mla_lbhd",
            ("L", "B", "H", "D"),
            latent=True,
            description="[layers, page_size, 1, kv_cache_dim]: SGLang's MLA host pool, layouts "
            "page_first_direct and layer_first",
            keyed=True,
        ),
        PageLayout(
            "sglang_pool_bytes",
            ("L", "H", "D"),
            description="[1, TP shares, page bytes] of uint8: a page of a hybrid model's side "
            "host pool in SGLang (Mamba states, sliding-window KV), the buffers its "
            "get_page_buffer_meta names back to back; the namespace's state names the pool "
            "and its format (client.sglang.pool_pages.side_namespace)",
            keyed=True,
        ),
    )
}


def detect_layout(
    shape: tuple[int, ...], block_size: int, num_kv_heads: int, head_size: int, *, mla: bool = False
) -> str:
    """The name of the layout whose blocks a per-layer cache tensor of ``shape`` holds,
    among the latent (``mla``) or the other layouts; raises ``KVStoreError`` naming the
    shape when none does. For MLA, ``num_kv_heads`` is 1 and ``head_size`` the latent
    width (576 for DeepSeek-V3). Called by the connectors when an engine registers its
    caches."""
    heads = 1 if mla else num_kv_heads
    for layout in LAYOUTS.values():
        if layout.latent == mla and layout.holds(
            tuple(shape), block_size=block_size, heads=heads, head_size=head_size
        ):
            return layout.name
    raise KVStoreError(
        f"unsupported KV cache layout {tuple(shape)} for block_size={block_size}, "
        f"kv_heads={num_kv_heads}, head_size={head_size}"
    )
