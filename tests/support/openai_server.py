"""vLLM's OpenAI-compatible server in a process of its own, for tests/vllm/test_vllm_serve.py,
tests/vllm/test_vllm_pd_serve.py and the benches: started on a free loopback port, waited for
(``/health``), asked for the connector's metrics, stopped; and README's server lines
read as a user's shell reads them (``server_line``)."""

from __future__ import annotations

import shlex
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.support.paths import engine_env

# A test server's KV cache: 64 MiB (65,536 tokens of the tiny Llama), not the GiB README's
# ``VLLM_CPU_KVCACHE_SPACE`` gives (it counts whole GiB, and overrides the flag): a server's
# worker zeroes its cache as it starts, about 1.5 s of CPU a GiB on the 2-core VM.
KV_CACHE_FLAGS = ["--kv-cache-memory-bytes", str(64 << 20)]


def small_kv_cache(env: dict[str, str]) -> dict[str, str]:
    """A README server line's variables, less ``VLLM_CPU_KVCACHE_SPACE``: a test's server
    takes ``KV_CACHE_FLAGS`` instead."""
    return {k: v for k, v in env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}


class OpenAIServer:
    """``argv`` (a server command whose ``--port`` the caller gives ``port``) with
    ``env`` added to this process's environment, its output appended to ``log``."""

    def __init__(
        self, argv: list[str], env: dict[str, str], log: Path | str, port: int, wait_s: float = 300
    ) -> None:
        self.port = port
        env = engine_env(env)
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                raise RuntimeError(
                    f"the server exited: {Path(log).read_text(errors='replace')[-3000:]}"
                )
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.2)  # a 1 s step waited half a second a start, on average
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {wait_s:.0f} s; see {log}")

    def kvstore_metric(self, name: str) -> float:
        """``vllm:kvstore_<name>`` summed over the engine's label sets."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in r.read().decode().splitlines()
                if line.startswith(f"vllm:kvstore_{name}{{")
            )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def server_line(line: str) -> tuple[dict[str, str], list[str]]:
    """A README server line (``VAR=value ... .venv/bin/python -m vllm...``): the variables
    it sets before the command, and the command's words."""
    words = shlex.split(line)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[:3] == [".venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"], words
    return env, words
