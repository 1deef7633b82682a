"""Disaggregated prefill/decode through the store against one colocated server, on vLLM
OpenAI servers started here, interleaved request by request.

    python bench/pd_ttft.py [--rounds 10] [--words 1000] [--hogs 2]   # output: bench/pd_ttft.txt

Systems (the same model, one storage node and Valkey started here):
- P/D: a prefill server (``kv_producer``) and a decode server (``kv_consumer``), driven
  as ``kvstore pd-proxy`` drives them (the prefill with ``do_remote_decode`` and one
  token, then the decode, streamed, with the prefill's ``kv_transfer_params``), here by
  hand so each leg is timed;
- colocated: one server with the connector (``kv_both``), the same request streamed.
Every request is a fresh prompt (nothing of it stored before), so the colocated server
computes it and the decode loads it. Per request: the P/D pair's time to first token
(prefill sent to the decode's first token), the decode's time to first token after the
prefill returned, and its wait for the announced pages (the decode's
``remote_prefill_wait_seconds`` histogram, read after each request); the colocated
server's time to first token. Phases: quiet, then ``--hogs`` busy loops beside
everything (loaded); in each the first request of freshly started servers is reported
apart (cold) from the rest (warm). Figures: median, p99 and min-max, and each P/D
figure as a ratio to the colocated median of the same phase."""

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
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.tools.launcher import LocalCluster  # noqa: E402
from kvstore.tools.pd_proxy import PREFILL_PARAMS  # noqa: E402
from kvstore.tools.procutil import free_port  # noqa: E402
from tests.support.openai_server import OpenAIServer  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
# bench/serve.py's model: large enough that a prefill costs what a load saves
from serve import MODEL  # noqa: E402

ENGINE = ROOT / "tests" / "support" / "vllm_engine.py"
FLAGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "4096"]
FLAGS += ["--served-model-name", "m", "--host", "127.0.0.1"]


def start(model: str, role: str, redis_url: str, log: Path) -> OpenAIServer:
    port = free_port()
    config = {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "client.vllm_connector",
        "kv_role": role,
    }
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--port", str(port), *FLAGS, "--kv-transfer-config", json.dumps(config)]
    env = {"KVSTORE_REDIS_URL": redis_url, "VLLM_CPU_KVCACHE_SPACE": "2"}
    return OpenAIServer(argv, env, log, port, wait_s=600)


def body(prompt: str, **extra) -> bytes:
    return json.dumps(
        {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    ).encode()


def post(port: int, data: bytes) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def first_token(port: int, data: bytes) -> float:
    """Seconds until the streamed completion's first text arrives."""
    started = time.perf_counter()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            text = line.startswith("data: ") and line != "data: [DONE]"
            if text and json.loads(line[6:])["choices"][0]["text"]:
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without text")


def pd_request(prefill: OpenAIServer, decode: OpenAIServer, prompt: str) -> dict[str, float]:
    waited = decode.kvstore_metric("remote_prefill_wait_seconds_sum")
    started = time.perf_counter()
    params = post(
        prefill.port, body(prompt, kv_transfer_params=dict(PREFILL_PARAMS), max_tokens=1)
    )["kv_transfer_params"]
    returned = time.perf_counter() - started
    after = first_token(decode.port, body(prompt, stream=True, kv_transfer_params=params))
    return {
        "pd_ttft": returned + after,
        "decode_ttft": after,
        "wait": decode.kvstore_metric("remote_prefill_wait_seconds_sum") - waited,
    }


def summary(values: list[float], base: float | None) -> str:
    values = sorted(values)
    p50 = statistics.median(values)
    p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
    ratio = f"  {p50 / base:.2f}x colocated" if base else ""
    return (
        f"p50 {p50 * 1000:8.1f} ms  p99 {p99 * 1000:8.1f}  "
        f"min-max {values[0] * 1000:.1f}-{values[-1] * 1000:.1f}{ratio}"
    )


def phase(model: str, hogs: int, rounds: int, words: int, seed: int, work: Path) -> list[str]:
    rng = random.Random(seed)
    prompts = [
        " ".join(f"t{rng.randrange(3, 512)}" for _ in range(words)) for _ in range(2 * rounds)
    ]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        with LocalCluster(servers=1, capacity="2GiB", slab_size="64MiB") as cluster:
            url = cluster.redis_url
            prefill = start(model, "kv_producer", url, work / f"prefill-{hogs}.log")
            decode = start(model, "kv_consumer", url, work / f"decode-{hogs}.log")
            colocated = start(model, "kv_both", url, work / f"colocated-{hogs}.log")
            try:
                pd: list[dict[str, float]] = []
                alone: list[float] = []
                for r in range(rounds):  # which system goes first alternates
                    systems = [("pd", prompts[2 * r]), ("colocated", prompts[2 * r + 1])]
                    for name, prompt in systems if r % 2 == 0 else systems[::-1]:
                        if name == "pd":
                            pd.append(pd_request(prefill, decode, prompt))
                        else:
                            alone.append(first_token(colocated.port, body(prompt, stream=True)))
                misses = decode.kvstore_metric("remote_prefill_deadline_misses_total")
            finally:
                for server in (prefill, decode, colocated):
                    server.stop()
    finally:
        for hog in busy:
            hog.kill()
    label = f"{'loaded' if hogs else 'quiet'} ({hogs} busy loops)"
    lines = [f"## {label}: {rounds} rounds, {words}-token prompts, deadline misses {misses:.0f}"]
    for part, picked in (("cold (first request)", slice(0, 1)), ("warm", slice(1, None))):
        base = statistics.median(alone[picked])
        lines.append(f"{part}:")
        lines.append(f"  colocated TTFT        {summary(alone[picked], None)}")
        for key, what in (
            ("pd_ttft", "P/D pair TTFT"),
            ("decode_ttft", "decode TTFT after P"),
            ("wait", "decode's wait"),
        ):
            values = [p[key] for p in pd[picked]]
            lines.append(f"  {what:<21} {summary(values, base if key == 'pd_ttft' else None)}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--words", type=int, default=1000)
    parser.add_argument("--hogs", type=int, default=2, help="busy loops in the loaded phase")
    parser.add_argument("--out", default=str(ROOT / "bench" / "pd_ttft.txt"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = str(work / "model")
        for command in (["write-model", model, json.dumps(MODEL)], ["write-tokenizer", model]):
            subprocess.run(
                [sys.executable, str(ENGINE), *command],
                check=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        lines = [f"# bench/pd_ttft.py --rounds {args.rounds} --words {args.words}"]
        for seed, hogs in ((1, 0), (2, args.hogs)):
            lines += phase(model, hogs, args.rounds, args.words, seed, work)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
