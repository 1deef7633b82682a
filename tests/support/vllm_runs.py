"""What the vLLM engine tests (tests/vllm/) share: one engine of a tiny model in its
own process (``run_engine``, ``run_engine_full``, over tests/support/engines.py), the
pages a store holds, how many tokens a hit loads, and a LoRA adapter for the tiny
Llama."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvstore.index import PageIndex
from kvstore.tools.launcher import LocalCluster
from tests.support import engines

BLOCK = 32  # the block size the engine tests run with
HIDDEN, LAYERS, KV_OUT = 128, 2, 2 * 32  # the tiny Llama: hidden size, layers, kv heads * head_dim


def run_engine_full(
    model_dir: str,
    prompts: list[list[int]],
    redis_url: str | None = None,
    role: str = "kv_both",
    extra: dict | None = None,
    mode: str = "sequential",
    env: dict | None = None,
    transfer_params: list[dict | None] | None = None,
    spec: dict | None = None,
    fresh: bool = False,
    **llm_kwargs,
) -> dict:
    """One engine in its own process (``tests.support.engines.run_engine``; ``fresh``: a new
    interpreter); its whole JSON answer (results, steps, metrics). ``spec``: more keys of
    tests/support/vllm_engine.py's spec."""
    spec = {
        "model_dir": model_dir,
        "prompts": prompts,
        "role": role,
        "prefix_caching": False,
        "llm_kwargs": llm_kwargs,
        "extra": extra or {},
        "mode": mode,
        "transfer_params": transfer_params,
        **(spec or {}),
    }
    if redis_url:
        spec["redis_url"] = redis_url
    return engines.run_engine(spec, env, fresh=fresh)


def run_engine(
    model_dir: str,
    prompts: list[list[int]],
    redis_url: str | None = None,
    role: str = "kv_both",
    **kwargs,
) -> list[dict]:
    return run_engine_full(model_dir, prompts, redis_url, role, **kwargs)["results"]


def stored_pages(cluster: LocalCluster) -> int:
    return sum(s.pages for s in PageIndex(cluster.redis_url).stats().namespaces)


def hit(prompt: list[int]) -> int:
    """Tokens a hit loads: the prompt's full blocks, less the block of its last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def write_lora_adapter(path: Path, base_model: str, seed: int, r: int = 8) -> str:
    """A random LoRA adapter on the tiny Llama's k_proj and v_proj, large enough (std
    0.5, alpha 2r) that the outputs differ from the base model's."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": r,
                "lora_alpha": 2 * r,
                "target_modules": ["k_proj", "v_proj"],
                "bias": "none",
                "base_model_name_or_path": base_model,
                "task_type": "CAUSAL_LM",
            }
        )
    )
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for proj in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, HIDDEN, generator=g) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(KV_OUT, r, generator=g) * 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)
