"""The connector in this process, without an engine: vLLM's own ``Scheduler`` (no model)
and the connector's worker half over real storage nodes, with CPU KV tensors.

``ConnectorHarness`` steps them as vLLM's engine core and CPU model runner do
(``vllm/v1/worker/kv_connector_model_runner_mixin.py``): the scheduler schedules, the
worker binds the step's metadata, starts its loads, the "model" computes, the worker
saves, reports finished loads and failed blocks, and the scheduler takes the output.

The model is a stand-in that makes wrong KV visible: the KV of each position is a value
chained over every token up to it (``kv_value``), written into the position's slot of
every layer and head when it is computed, and each sampled token is read back from the
cache over the whole prefix (``next_token``). So a loaded block with wrong or missing KV
changes the tokens that follow, as it would on a real model, and ``check_cache`` names
any position whose KV differs from what computing it gives.

A real engine is still what the ``test_vllm*`` files run (one per family); this is for
the connector's logic (chunked prefill, failed loads, the breaker, loads beside decodes),
at a small fraction of an engine's start-up.

With a ``MemoryStore`` (tests/support/memory_store.py) in place of a store's URL, both
halves of the connector open their stores in it (``KVStoreConnector``'s ``stores``):
the scheduler looks up there and the real worker (``ConnectorWorker``: its loader,
saver and pin threads) loads and saves real page bytes there. No node, no process, for
the fast tier (tests/vllm/test_scheduler_decisions.py, test_worker_decisions.py); each
step then ends once its saves are stored and its pins made (``settle``), so a test
reads the store as the step left it."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from client.memory.device_pages import DeviceCopier, default_copier
from client.stats import ClientStats
from client.vllm.connector import KVStoreConnector
from tests.support.memory_store import MemoryClient, MemoryStore
from tests.support.stand_in_model import (
    BLOCK,
    HEAD,
    KV_HEADS,
    LAYERS,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    PROMPT_D,
    SHARED,
    VOCAB,
    WEIGHTS,
    attention_config,
    engine_args,
    kv_value,
    write_config,
)

# the stand-in model's names, for the tests that drive the harness
__all__ = [
    "BLOCK",
    "HEAD",
    "KV_HEADS",
    "LAYERS",
    "PROMPT_A",
    "PROMPT_B",
    "PROMPT_C",
    "PROMPT_D",
    "SHARED",
    "VOCAB",
    "WEIGHTS",
    "ConnectorHarness",
    "Finished",
    "MemoryStoreConnector",
    "attention_config",
    "kv_value",
    "write_config",
]


@dataclass
class Finished:
    """A request's end: its generated tokens and the prompt tokens the connector
    loaded (vLLM's ``num_cached_tokens`` with its own prefix cache off)."""

    tokens: list[int]
    num_cached_tokens: int
    # what the connector's request_finished returned (a P/D prefill's announcement)
    kv_transfer_params: dict | None = None


@dataclass
class _Running:
    tokens: list[int]  # prompt, then generated
    prompt_len: int
    request: Request
    cached: int = 0  # prompt tokens not computed (vLLM's num_cached_tokens)
    blocks: list[int] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)  # kv_value of each computed position


class ConnectorHarness:
    """One "engine": a scheduler, one worker and its CPU KV cache, with the connector
    configured by ``extra`` (``kv_connector_extra_config``) for ``redis_url``.
    ``max_batched``: tokens per step (chunked prefill below a prompt's length)."""

    def __init__(
        self,
        model_dir: str,
        redis_url: str | None,
        *,
        store: MemoryStore | None = None,
        role: str = "kv_both",
        extra: dict | None = None,
        num_blocks: int = 64,
        max_batched: int = 2048,
        device: Callable[[ClientStats], DeviceCopier | None] = default_copier,
        layer_waits: bool = True,
        events_endpoint: str | None = None,
    ) -> None:
        """``device``: the worker client's device copier (``HostCopier`` runs the GPU's
        load path on the CPU); ``layer_waits``: whether the forward calls
        ``wait_for_layer_load`` before each layer, as vLLM's attention layers do;
        ``events_endpoint``: the ZMQ address the scheduler publishes KV events on
        (vLLM's publisher, ``kv_events_config``), None for none; ``store``: the pages
        are kept in it (``redis_url`` None), by ``MemoryStoreConnector``."""
        engine_id = f"memory-{id(self)}"
        if store is not None:
            _MEMORY[engine_id] = store
        args = engine_args(
            model_dir,
            redis_url,
            engine_id if store is not None else None,
            role=role,
            extra=extra,
            max_batched=max_batched,
            events_endpoint=events_endpoint,
        )
        self.vllm_config = args.create_engine_config()
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.kv_cache_config = attention_config(names, num_blocks)
        init_none_hash(sha256_cbor)
        self._hasher = get_request_block_hasher(BLOCK, sha256_cbor)
        opened = len(store.opened) if store is not None else 0
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK,
            log_stats=True,
        )
        self._names = names if layer_waits else []
        self._stats: KVConnectorStats | None = None
        # vLLM's connector view: [blocks, kv heads, block, 2 * head size] per layer
        self.layers = [torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD) for _ in names]
        self.store = store
        if store is not None:  # the scheduler's connector opened its engine's pages first
            assert len(store.opened) > opened, (
                "a MemoryStore's harness loads: kv_both or kv_consumer"
            )
            # the scheduler's lookups; the worker opens its own, as a worker's client
            self.lookups: MemoryClient = store.opened[opened]
        connector = KVStoreConnector if store is None else MemoryStoreConnector
        self.worker = connector(
            self.vllm_config,
            KVConnectorRole.WORKER,
            self.kv_cache_config,
            ranks=lambda: (0, 0),
            device=device,
        )
        self.worker.register_kv_caches(dict(zip(names, self.layers)))
        self._running: dict[str, _Running] = {}
        self.finished: dict[str, Finished] = {}
        # per step, the requests with output: how many tokens each has generated
        self.steps: list[dict[str, int]] = []

    # ---- requests --------------------------------------------------------------------

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int = 8,
        *,
        cache_salt: str | None = None,
        **transfer,
    ) -> None:
        """Queue a request (``transfer``: its ``kv_transfer_params``)."""
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": transfer} if transfer else None,
        )
        request = Request(
            req_id, list(prompt), params, None, cache_salt=cache_salt, block_hasher=self._hasher
        )
        self.scheduler.add_request(request)
        self._running[req_id] = _Running(list(prompt), len(prompt), request)

    def run(self, max_steps: int = 2000) -> dict[str, Finished]:
        """Step until every request finished; what each generated."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return self.finished
            self.step()
        raise AssertionError(f"requests still running after {max_steps} steps")

    def generate(self, prompts: dict[str, list[int]], max_tokens: int = 8) -> dict[str, Finished]:
        for req_id, prompt in prompts.items():
            self.add(req_id, prompt, max_tokens)
        return self.run()

    # ---- one engine step -------------------------------------------------------------

    def step(self) -> None:
        out = self.scheduler.schedule()
        assert out.kv_connector_metadata is not None
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)  # type: ignore[arg-type]  # the CPU runner passes its forward context
        self._track_blocks(out)
        for name in self._names:  # each attention layer waits for its KV, then reads it
            worker.wait_for_layer_load(name)
        sampled = self._forward(out)
        worker.wait_for_save()
        if self.store is not None:
            self.settle()
        results = worker.get_transfer_results(out.finished_req_ids)
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_cache_events=worker.get_kv_connector_kv_cache_events(),
        )
        self._collect()
        worker.clear_connector_metadata()
        self._finish_step(out, sampled, connector_output)

    def settle(self) -> None:
        """Wait until the worker's saves handed over so far are stored and their pins
        made (a ``MemoryStore``'s harness does after each step's ``wait_for_save``)."""
        side = self.worker._worker_side
        wait_futures(list(side._saves.in_flight))
        wait_futures(list(side._pins.in_flight))

    def _finish_step(
        self, out, sampled: dict[str, list[int]], connector_output: KVConnectorOutput
    ) -> None:
        """The "model"'s output back to the scheduler, and what each request generated."""
        req_ids = list(out.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=connector_output,
        )
        counts: dict[str, int] = {}
        for engine_output in self.scheduler.update_from_output(out, output).values():
            for request_output in engine_output.outputs:
                running = self._running[request_output.request_id]
                # what the scheduler kept of the step's tokens (it drops a step's token
                # of a request whose sync load failed)
                running.tokens.extend(request_output.new_token_ids)
                counts[request_output.request_id] = len(running.tokens) - running.prompt_len
                if request_output.prefill_stats is not None:  # its first output
                    running.cached = request_output.prefill_stats.num_cached_tokens
                if request_output.finish_reason is not None:
                    del self._running[request_output.request_id]
                    self.finished[request_output.request_id] = Finished(
                        running.tokens[running.prompt_len :],
                        running.cached,
                        request_output.kv_transfer_params,
                    )
        self.steps.append(counts)

    def _track_blocks(self, out) -> None:
        for new in out.scheduled_new_reqs:
            self._running[new.req_id].blocks = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            more = cached.new_block_ids[i]
            if more is None:
                continue
            if req_id in cached.resumed_req_ids:
                self._running[req_id].blocks = list(more[0])
            else:
                self._running[req_id].blocks.extend(more[0])

    def _forward(self, out) -> dict[str, list[int]]:
        """The stand-in model: the KV of each scheduled position, and a token for each
        request whose scheduled tokens reach the end of what it holds."""
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        sampled: dict[str, list[int]] = {}
        for req_id, count in out.num_scheduled_tokens.items():
            running = self._running[req_id]
            start = computed[req_id]
            # positions before ``start`` were loaded or computed: their KV is in the cache
            previous = self._read(running, start - 1) if start else 0
            for pos in range(start, start + count):
                previous = kv_value(previous, running.tokens[pos])
                self._write(running, pos, previous)
            if start + count >= len(running.tokens):
                token = self._next_token(running, start + count)
                sampled[req_id] = [token]
        return sampled

    def _slot(self, running: _Running, pos: int) -> tuple[int, int]:
        return running.blocks[pos // BLOCK], pos % BLOCK

    def _write(self, running: _Running, pos: int, value: int) -> None:
        block, offset = self._slot(running, pos)
        for layer, kv in enumerate(self.layers):
            kv[block, :, offset, :] = float(value + layer)

    def _read(self, running: _Running, pos: int) -> int:
        block, offset = self._slot(running, pos)
        return int(self.layers[0][block, 0, offset, 0].item())

    def _next_token(self, running: _Running, length: int) -> int:
        """Read from the cache over the whole prefix, as attention does."""
        total = sum(self._read(running, pos) for pos in range(length))
        return total % VOCAB

    # ---- checks ----------------------------------------------------------------------

    def check_cache(self, req_id: str, prompt: list[int], upto: int) -> list[int]:
        """Positions below ``upto`` of a running request whose KV (every layer, head
        and element) is not what computing ``prompt`` gives."""
        running = self._running[req_id]
        wrong = []
        value = 0
        for pos in range(upto):
            value = kv_value(value, prompt[pos])
            block, offset = self._slot(running, pos)
            for layer, kv in enumerate(self.layers):
                if not torch.all(kv[block, :, offset, :] == float(value + layer)):
                    wrong.append(pos)
                    break
        return wrong

    def _collect(self) -> None:
        """Take both halves' statistics since the last call, as vLLM does each step (the
        lookups' are the scheduler's)."""
        for side in (self.worker, self.scheduler.connector):
            if side is None:
                continue
            stats = side.get_kv_connector_stats()
            if stats is not None:
                self._stats = stats if self._stats is None else self._stats.aggregate(stats)

    def metrics(self) -> dict:
        """The connector's statistics so far, both halves (``KVStoreConnectorStats.data``),
        including what the saver thread counted since the last step."""
        self._collect()
        return dict(self._stats.data) if self._stats is not None else {}

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
        _MEMORY.pop(self.vllm_config.kv_transfer_config.engine_id, None)

    def __enter__(self) -> ConnectorHarness:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# engine id -> the store of a harness made with one (``MemoryStoreConnector`` reads it)
_MEMORY: dict[str, MemoryStore] = {}


class MemoryStoreConnector(KVStoreConnector):
    """The connector whose halves open their stores in its harness's ``MemoryStore``
    (vLLM's ``Scheduler`` builds the scheduler's from the config: the engine id names
    the store; the harness builds the worker's)."""

    def __init__(self, vllm_config, role, kv_cache_config=None, **kw) -> None:
        store = _MEMORY[vllm_config.kv_transfer_config.engine_id]
        super().__init__(vllm_config, role, kv_cache_config, stores=store.client, **kw)
