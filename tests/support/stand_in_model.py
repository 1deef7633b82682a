"""The stand-in model of the in-process connector tests (tests/support/connector_harness.py):
its geometry (the tiny Llama's config, no weights), its KV (a value chained over every
token up to a position, ``kv_value``, so wrong KV changes what follows), the revision
its pages are keyed by, its KV-cache config, and the prompts the tests share."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from tests.support.tiny_models import TINY_LLAMA, write_tiny_llama_config

BLOCK = 32
VOCAB = TINY_LLAMA["vocab_size"]
LAYERS, KV_HEADS, HEAD = (
    TINY_LLAMA[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")
)
_MOD = 1_000_003
# The stand-in model has no checkpoint to fingerprint: its pages are keyed by this
# revision (``weights_revision``, as an operator names weights the connector cannot read)
WEIGHTS = "stand-in-model-v1"


# The prompts of the in-process tests (tests/vllm/test_vllm_inprocess.py,
# test_vllm_store_restart.py)
_rng = random.Random(11)
PROMPT_A = [_rng.randrange(512) for _ in range(200)]  # 6 full blocks + 8 tokens
SHARED = 4
PROMPT_B = PROMPT_A[: SHARED * BLOCK] + [_rng.randrange(512) for _ in range(52)]
PROMPT_C = [_rng.randrange(512) for _ in range(230)]  # 7 full blocks
PROMPT_D = [_rng.randrange(512) for _ in range(70)]


def kv_value(previous: int, token: int) -> int:
    """The stand-in model's KV of a position: chained over every token up to it."""
    return (previous * 131 + token + 1) % _MOD


def write_config(path: Path) -> str:
    """The tiny Llama's config (no weights: nothing here runs the model)."""
    return write_tiny_llama_config(str(path))


def attention_config(names: list[str], num_blocks: int) -> KVCacheConfig:
    """One full-attention group of every layer in ``names``, each layer's cache a
    region of its own (layer-outermost, as vLLM's CPU runner makes them)."""
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=spec.page_size_bytes * num_blocks * len(names),
                layers=names,
                layer_stride=spec.page_size_bytes * num_blocks,
                block_stride=spec.page_size_bytes,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def engine_args(
    model_dir: str,
    redis_url: str | None,
    engine_id: str | None,
    *,
    role: str,
    extra: dict | None,
    max_batched: int,
    events_endpoint: str | None,
) -> EngineArgs:
    """The stand-in engine's arguments: the connector configured by ``extra`` for
    ``redis_url``, or, with ``engine_id``, the harness's ``MemoryStoreConnector`` over
    the memory store that id names (ConnectorHarness)."""
    return EngineArgs(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        block_size=BLOCK,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=max_batched,
        max_num_seqs=8,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector" if engine_id is None else "MemoryStoreConnector",
            kv_connector_module_path="client.vllm_connector"
            if engine_id is None
            else "tests.support.connector_harness",
            kv_role=role,
            engine_id=engine_id,
            kv_connector_extra_config={
                # never connected to with a store: the connector asks for one
                "redis_url": redis_url or "redis://in-memory.invalid:6379/0",
                "weights_revision": WEIGHTS,
                **(extra or {}),
            },
        ),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint
        )
        if events_endpoint
        else None,
    )
