"""Runs a real vLLM engine on a tiny random-weight Llama: ``python tests/vllm_engine.py '<json>'``.

spec: {"model_dir", "prompts": [[token ids], ...], "redis_url" (omit for a baseline
engine without connector), "role" ("kv_producer" | "kv_consumer" | "kv_both"),
"extra": {...}}. Prints one JSON line: per prompt the generated token ids and
num_cached_tokens."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK_SIZE = 32


def write_tiny_llama(path: str) -> None:
    """Random weights large enough that the output depends on the context."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, vocab_size=512, max_position_embeddings=512, initializer_range=0.2,
        torch_dtype="float32", tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def main() -> int:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if spec.get("redis_url"):
        kv = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="client.vllm_connector",
            kv_role=spec.get("role", "kv_both"), kv_connector_extra_config={"redis_url": spec["redis_url"], **spec.get("extra", {})},
        )
    llm = LLM(
        model=spec["model_dir"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=BLOCK_SIZE,
        max_model_len=512, gpu_memory_utilization=0.3, kv_transfer_config=kv, seed=0,
        enable_prefix_caching=spec.get("prefix_caching", True), **spec.get("llm_kwargs", {}),
    )
    params = SamplingParams(temperature=0, max_tokens=12, detokenize=False, ignore_eos=True)
    results = []
    for prompt in spec["prompts"]:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        results.append({"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens})
    print(json.dumps({"results": results}), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "write-model":
        write_tiny_llama(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
