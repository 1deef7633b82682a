"""NVIDIA Dynamo's standalone KV indexer for the test_router_dynamo* files: found in
this interpreter or the one ``KVSTORE_DYNAMO_PYTHON`` names (``DYNAMO``; the files skip
without it), run on a free port (``DynamoIndexer``, the ``dynamo`` fixture), and the
puts and prompts the tests feed a node."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvstore.tools.procutil import free_port, stop_process
from tests.support.helpers import run_worker, spec, wait_for

PAGE = 256 << 10  # 64-token blocks; a 4 MiB pool holds 12 pages past its watermarks
OPTS = {"lease_ms": 0}
INSTANCE = 7  # the worker id the node is registered under in Dynamo's indexer


def _dynamo_python() -> tuple[str, str] | None:
    """(interpreter, ai-dynamo-runtime version) of the first interpreter whose packages
    hold ``dynamo.indexer``: ``KVSTORE_DYNAMO_PYTHON``'s virtualenv, then this one.

    Read from the virtualenv's files, not by starting the interpreter: this runs when the
    test files are collected, and the fast tier refuses a Python process there
    (tests/conftest.py). A broken install then fails the tests instead of skipping them."""
    external = os.environ.get("KVSTORE_DYNAMO_PYTHON")
    if external:
        root = Path(external).parent.parent
        for site in sorted(root.glob("lib/python3*/site-packages")):
            if (site / "dynamo" / "indexer").is_dir():
                for dist in importlib.metadata.distributions(path=[str(site)]):
                    if dist.metadata["Name"] == "ai-dynamo-runtime":
                        return external, dist.version
    if importlib.util.find_spec("dynamo") is not None:
        try:
            if importlib.util.find_spec("dynamo.indexer") is not None:
                return sys.executable, importlib.metadata.version("ai-dynamo-runtime")
        except (ImportError, importlib.metadata.PackageNotFoundError):
            pass
    return None


DYNAMO = _dynamo_python()
skip_without_dynamo = pytest.mark.skipif(
    DYNAMO is None,
    reason="NVIDIA Dynamo (ai-dynamo-runtime) is not importable; set KVSTORE_DYNAMO_PYTHON",
)


class DynamoIndexer:
    """``python -m dynamo.indexer`` on a free port, and its HTTP API."""

    def __init__(self, log: Path) -> None:
        assert DYNAMO is not None
        self.port = free_port()
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(
            [DYNAMO[0], "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._up, 30, "Dynamo's indexer to answer", interval=0.1)

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-2000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/workers", timeout=1).read()
            return True
        except OSError:
            return False

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"{}")

    def register(
        self, endpoint: str, model: str, block_size: int, replay: str | None = None
    ) -> None:
        body = {
            "instance_id": INSTANCE,
            "endpoint": endpoint,
            "model_name": model,
            "block_size": block_size,
        }
        if replay:
            body["replay_endpoint"] = replay
        self.post("/register", body)

    def host_tokens(self, model: str, token_ids: list[int], instance: int = INSTANCE) -> int:
        """The tokens of the longest prefix of ``token_ids`` Dynamo credits worker
        ``instance`` with on its host (CPU) tier; 0 when it credits none."""
        got = self.post("/query", {"token_ids": token_ids, "model_name": model})
        return int(got.get("instances", {}).get(str(instance), {}).get("cpu", 0))

    def warnings(self) -> list[str]:
        import re

        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text())
        return [line for line in text.splitlines() if " WARN " in line or " ERROR " in line]

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self._out.close()


@pytest.fixture()
def dynamo(tmp_path):
    idx = DynamoIndexer(tmp_path / "dynamo-indexer.log")
    yield idx
    idx.stop()


def put(cluster, ns, token_lists) -> int:
    reports = run_worker(spec(cluster, ns, "put_pages", token_lists=token_lists, options=OPTS))[
        "reports"
    ]
    return sum(r["stored"] for r in reports)


def prompts(ns, count: int, blocks: int, base: int = 1) -> list[list[int]]:
    return [
        list(range(b * 100_000, b * 100_000 + blocks * ns.block_size))
        for b in range(base, base + count)
    ]


def subscribed(dynamo: DynamoIndexer, cluster, ns) -> None:
    """Return once Dynamo indexes the node's events: the SUB connection has no handshake
    (ZMQ's slow joiner), so one-block prompts are put until one is scored."""
    for k in range(50):
        warm = prompts(ns, 1, 1, base=900 + k)[0]
        put(cluster, ns, [warm])
        try:
            wait_for(lambda w=warm: dynamo.host_tokens(ns.model, w) == ns.block_size, 1, "")
            return
        except AssertionError:
            continue
    raise AssertionError(f"Dynamo indexed no event of the node: {dynamo.warnings()}")
