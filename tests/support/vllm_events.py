"""An engine of the tiny Llama that publishes KV events, and a subscriber that reads
them with vLLM's own types (tests/vllm/test_vllm_events.py, test_vllm_mamba.py)."""

from __future__ import annotations

import threading

import msgspec
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from tests.support import engines

TOPIC = "kv@engine-0@tiny-llama-events"
MODEL = {
    "model": "tiny-llama-events"
}  # a fixed name: the namespace does not depend on the temporary path


class Subscriber:
    """A SUB socket bound on a free port, for an engine's publisher to connect to (as
    llm-d's manager binds and engines connect), read on a thread of its own from the
    start: a PUB peer that goes away takes with it what its subscriber has not read."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                self.frames.append(self._sock.recv_multipart())

    def close(self) -> list[tuple[str, int, KVEventBatch]]:
        """Stop reading; each message as (topic, sequence, batch), decoded by vLLM's types."""
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        return [
            (t.decode(), int.from_bytes(s, "big"), decoder.decode(p)) for t, s, p in self.frames
        ]


def run_events_engine(
    model_dir: str,
    prompts: list[list[int]],
    redis_url: str,
    port: int,
    *,
    extras: list | None = None,
    extra: dict | None = None,
    transfer_params: list | None = None,
    env: dict | None = None,
    drain_s: float = 10,
    **llm_kwargs,
) -> dict:
    """One engine publishing KV events to ``port`` (tests/support/vllm_engine.py), prefix caching on
    (so the engine's own BlockStored events are there to compare with); its JSON answer."""
    spec = {
        "model_dir": model_dir,
        "prompts": prompts,
        "prompt_extras": extras,
        "redis_url": redis_url,
        "role": "kv_both",
        "prefix_caching": True,
        "extra": {**MODEL, **(extra or {})},
        "transfer_params": transfer_params,
        "llm_kwargs": llm_kwargs,
        "drain_s": drain_s,
        "kv_events": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{port}",
            "topic": TOPIC,
        },
    }
    return engines.run_engine(spec, env)


def stored_events(
    messages: list[tuple[str, int, KVEventBatch]],
) -> tuple[list[BlockStored], list[BlockStored]]:
    """(the connector's BlockStored events, the engine's own), each in publishing order."""
    events = [e for _, _, batch in messages for e in batch.events if isinstance(e, BlockStored)]
    return [e for e in events if e.ownership == "kvstore"], [
        e for e in events if e.ownership is None
    ]
