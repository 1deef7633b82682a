"""Runs a real vLLM engine on a tiny random-weight Llama: ``python tests/support/vllm_engine.py '<json>'``.

spec keys:
- ``model_dir``; ``prompts``: [[token ids], ...]; ``max_tokens`` (12);
- ``example_connector_path``: run vLLM's own ``ExampleConnector`` (kv_both) storing there
  instead, the reference for what a connector's load gives;
- ``redis_url`` (omit for an engine without connector), ``role`` ("kv_producer" |
  "kv_consumer" | "kv_both"), ``extra`` (more ``kv_connector_extra_config``);
- ``prefix_caching`` (vLLM's own, default on), ``llm_kwargs`` (more ``LLM`` arguments);
- ``spec_decode_metrics``: also answer ``spec_decode``, vLLM's speculative-decoding
  counters (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``); speculative
  decoding itself is ``llm_kwargs`` ``speculative_config``;
- ``mode``: "sequential" (one prompt at a time, timed: ``ttft``, ``decode_tps``,
  ``seconds``, ``decode_steps``, the seconds of each step after the first token, and
  ``first_steps``, those of each step up to the first token), or "steps" (every prompt
  added at once, then the engine stepped by hand, recording per step how many tokens
  each request has: shows which ran while others waited);
- ``warmup``: prompts generated (untimed, results dropped) before the measured ones;
- ``transfer_params``: per prompt, its ``kv_transfer_params`` (or null), e.g.
  ``{"kvstore_save": false}``;
- ``prompt_extras``: per prompt, null or a dict of optional ``cache_salt`` (str, into the
  prompt), ``lora`` (``[name, int id, adapter dir]``: the request's ``LoRARequest``; the
  engine needs ``llm_kwargs`` ``enable_lora``, ``max_lora_rank``, ``max_loras``) and
  ``embeds_seed`` (int: the prompt goes in as prompt embeddings instead of its token ids,
  ``torch.manual_seed(seed); torch.randn(len(prompt), hidden_size) * 0.5``, an
  ``EmbedsPrompt``; the engine needs ``llm_kwargs`` ``enable_prompt_embeds``);
- ``kv_events``: the engine's ``kv_events_config`` (``KVEventsConfig`` fields, e.g.
  ``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557",
  "topic": "kv@engine@tiny"}``); after the prompts the KV events of saves still in
  flight are published before the engine exits (``drain_events``; ``drain_s``, default
  10: the most it waits, and what a multiprocess engine core is given);
- ``idle_cpu_s``: at the end, this process's CPU time over that many seconds with no
  request, as a share of one core (``idle_cpu``: what the engine's and the connector's
  threads use while idle);
- ``beside_copy_bytes``: in sequential mode, a thread copies and hashes this many bytes
  as a same-host load does (``copy_checksummed``) from the moment the last prompt is
  added: the best a load overlapped with the step could do (``beside_copy_seconds`` is
  how long the copy took beside it).

Prints one JSON line: per prompt the generated token ids, num_cached_tokens and
seconds; in steps mode also ``steps``; and ``metrics``, the engine's ``vllm:kvstore_*``
Prometheus values (the connector's statistics as vLLM exports them), at the end and
(``warmup_metrics``) after the warm-up.

``python tests/support/vllm_engine.py write-model DIR ['{"hidden_size": 1024, ...}']`` writes the
model (the writers are tests/support/tiny_models.py) (the JSON overrides LlamaConfig fields; the bench uses a larger one; its ``seed``
key, default 0, seeds the random weights instead: the same config, other weights);
``write-mla-model DIR`` writes a tiny DeepSeek-V2 (MLA, block size 16);
``write-gemma3-model DIR`` a tiny Gemma-3 text model (sliding-window layers of 64 tokens
between full-attention ones); ``write-eagle-model DIR`` an EAGLE-1 head for the tiny
Llama (``speculative_config`` ``{"method": "eagle", "model": DIR}``);
``write-nemotron-h-model DIR [CONFIG]`` a tiny Nemotron-H (Mamba-2 and attention layers);
``write-gpt-oss-model DIR`` a tiny gpt-oss (sliding and full layers with attention
sinks, mixture of experts);
``write-tokenizer DIR`` adds a word-level tokenizer (``t0`` ... ``t511``)."""

from __future__ import annotations

import json
import os
import sys
import time

BLOCK_SIZE = 32
# The KV cache of a test's engine: 64 MiB (65,536 tokens of the tiny Llama), not the 1 GiB
# ``VLLM_CPU_KVCACHE_SPACE=1`` gives (its least: it counts whole GiB). Each engine zeroed
# its cache when it started and freed it when it stopped: 1 GiB took 2.5 of a TP=1
# engine's 4.2 s (cProfile, the 2-core VM); with 64 MiB the engine took 1.7 s, the same
# tokens. ``llm_kwargs`` ``kv_cache_memory_bytes`` sets another size.
KV_CACHE_BYTES = 64 << 20


def kvstore_metrics(llm) -> dict:
    """The engine's ``vllm:kvstore_*`` counters and the lookup histogram's count, sum and
    cumulative buckets."""
    out: dict = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:kvstore_"):
            continue
        name = metric.name.removeprefix("vllm:kvstore_")
        if hasattr(metric, "buckets"):  # histogram (one engine here)
            out[name + "_count"] = metric.count
            out[name + "_sum"] = metric.sum
            out[name + "_buckets"] = dict(metric.buckets)  # upper bound -> cumulative count
        elif hasattr(metric, "value"):
            out[name] = out.get(name, 0) + metric.value
    return out


class _BesideCopy:
    """A load's copy and hash, run on a thread of its own beside the engine step: the
    same call a same-host load makes (``copy_checksummed``: the C loop on this thread
    and the checksum helper, without the GIL), from one contiguous source page at a
    time into 10 pieces per page, as a node's slot into a 10-layer cache."""

    LAYERS = 10

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        piece = nbytes // 96 // self.LAYERS  # the bench's 96 pages
        self.src = np.ones(
            96 * self.LAYERS * piece, np.uint8
        )  # both faulted in now, as the store's pages and the cache are
        self.dst = np.zeros((self.LAYERS, 96, piece), np.uint8)
        self.pairs = [
            (
                tuple(self.dst[layer, page] for layer in range(self.LAYERS)),
                self.src[page * self.LAYERS * piece : (page + 1) * self.LAYERS * piece],
            )
            for page in range(96)
        ]
        self.seconds = 0.0
        self.thread = None

    def start(self) -> None:
        import threading

        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from kvstore.pages.checksum import copy_checksummed

        began = time.perf_counter()
        copy_checksummed(self.pairs)
        self.seconds = time.perf_counter() - began


def make_prompt(prompt: list[int], extras: dict | None, hidden_size: int):
    """The prompt to hand the engine (a ``TokensPrompt``, or an ``EmbedsPrompt`` for
    ``embeds_seed``, with its ``cache_salt``) and its ``LoRARequest`` or None."""
    from vllm.inputs import EmbedsPrompt, TokensPrompt

    extras = extras or {}
    if extras.get("embeds_seed") is not None:
        import torch

        torch.manual_seed(extras["embeds_seed"])
        made = EmbedsPrompt(prompt_embeds=torch.randn(len(prompt), hidden_size) * 0.5)
    else:
        made = TokensPrompt(prompt_token_ids=prompt)
    if extras.get("cache_salt") is not None:
        made["cache_salt"] = extras["cache_salt"]
    lora = None
    if extras.get("lora"):
        from vllm.lora.request import LoRARequest

        name, lora_id, path = extras["lora"]
        lora = LoRARequest(name, lora_id, path)
    return made, lora


def result(o) -> dict:
    return {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}


def drain_events(engine, seconds: float, out: dict) -> None:
    """Let the KV events of saves still in flight be published before the engine exits.
    The connector keeps the scheduler busy while a save's event waits for its workers
    (``has_pending_push_work``): an engine core in this process is stepped until it
    holds no work (``out["drained"]``); one in its own process (multiprocess mode) steps
    through that by itself, and gets ``seconds`` to. Then vLLM's publisher, which closes
    its socket without lingering at exit, is given time to hand the last batches to ZMQ."""
    core = getattr(engine.engine_core, "engine_core", None)
    deadline = time.monotonic() + seconds
    if core is None:
        time.sleep(seconds)
        return
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        engine.step()
    out["drained"] = not core.scheduler.has_requests()
    queue = getattr(core.scheduler.kv_event_publisher, "_event_queue", None)
    while queue is not None and not queue.empty() and time.monotonic() < deadline + 2:
        time.sleep(0.01)
    time.sleep(0.3)


def main(spec: dict) -> int:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    kv = None
    if spec.get(
        "example_connector_path"
    ):  # vLLM's own reference connector, saving to and loading from files
        kv = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["example_connector_path"]},
        )
    elif spec.get("redis_url"):
        kv = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="client.vllm_connector",
            kv_role=spec.get("role", "kv_both"),
            kv_connector_extra_config={
                "redis_url": spec["redis_url"],
                # the scheduler's 50 ms default budget turns a lookup slowed by a loaded
                # 2-core CI machine into a miss (a TP=2 speculating engine's whole prompt
                # read 0 cached tokens once): the budget's own behaviour is tested in
                # test_scheduler_decisions.py and test_vllm_inprocess.py
                "lookup_budget_ms": 2000,
                **spec.get("extra", {}),
            },
        )
    llm_kwargs = {
        "max_model_len": 512,
        "block_size": BLOCK_SIZE,
        "enforce_eager": True,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        **spec.get("llm_kwargs", {}),
    }
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        llm_kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events"])
    llm = LLM(
        model=spec["model_dir"],
        skip_tokenizer_init=True,
        dtype="float32",
        gpu_memory_utilization=0.3,
        kv_transfer_config=kv,
        seed=0,
        disable_log_stats=False,
        enable_prefix_caching=spec.get("prefix_caching", True),
        **llm_kwargs,
    )

    def params(
        transfer: dict | None = None,
    ) -> SamplingParams:  # LLM.generate turns the params it gets into FINAL_ONLY: one each
        return SamplingParams(
            temperature=0,
            max_tokens=spec.get("max_tokens", 12),
            detokenize=False,
            ignore_eos=True,
            output_kind=RequestOutputKind.CUMULATIVE,
            extra_args={"kv_transfer_params": transfer} if transfer else None,
        )

    transfers = spec.get("transfer_params") or [None] * len(spec["prompts"])
    extras = spec.get("prompt_extras") or [None] * len(spec["prompts"])
    hidden_size = llm.llm_engine.model_config.get_hidden_size()
    beside = _BesideCopy(spec["beside_copy_bytes"]) if spec.get("beside_copy_bytes") else None

    for prompt in spec.get("warmup", []):
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params(), use_tqdm=False)
    results: list[dict] = []
    out: dict = {"results": results}
    if kv is not None:  # so that figures of the measured prompts can leave the warm-up out
        out["warmup_metrics"] = kvstore_metrics(llm)
    engine = llm.llm_engine
    if spec.get("mode", "sequential") == "steps":
        ids = [f"r{i}" for i in range(len(spec["prompts"]))]
        for req_id, prompt, transfer, extra in zip(ids, spec["prompts"], transfers, extras):
            made, lora = make_prompt(prompt, extra, hidden_size)
            engine.add_request(req_id, made, params(transfer), lora_request=lora)
        steps: list[dict[str, int]] = []
        final = {}
        while engine.has_unfinished_requests():
            counts = {}
            for o in engine.step():
                counts[o.request_id] = len(o.outputs[0].token_ids)
                final[o.request_id] = o
            steps.append(counts)
        results.extend(result(final[req_id]) for req_id in ids)
        out["steps"] = steps
    else:
        for i, (prompt, transfer, extra) in enumerate(zip(spec["prompts"], transfers, extras)):
            made, lora = make_prompt(prompt, extra, hidden_size)
            started = time.perf_counter()
            if beside is not None and i == len(spec["prompts"]) - 1:
                beside.start()
            engine.add_request(f"s{i}", made, params(transfer), lora_request=lora)
            first = None
            step_ends = []
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if first is None and o.outputs[0].token_ids:
                        first = time.perf_counter()
                    last = o
                step_ends.append(time.perf_counter())
            ended = time.perf_counter()
            n = len(last.outputs[0].token_ids)
            decode_steps = [round(b - a, 5) for a, b in zip(step_ends, step_ends[1:]) if a >= first]
            first_steps = [
                round(b - a, 5) for a, b in zip([started, *step_ends], step_ends) if a < first
            ]
            results.append(
                result(last)
                | {
                    "seconds": ended - started,
                    "ttft": first - started,
                    "decode_steps": decode_steps,
                    "first_steps": first_steps,
                    "decode_tps": (n - 1) / (ended - first) if n > 1 else None,
                }
            )
    if spec.get("kv_events"):
        drain_events(engine, spec.get("drain_s", 10), out)
    if spec.get("idle_cpu_s"):
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(spec["idle_cpu_s"])
        out["idle_cpu"] = (time.process_time() - cpu) / (time.monotonic() - wall)
    if kv is not None:
        out["metrics"] = kvstore_metrics(llm)
    if spec.get(
        "spec_decode_metrics"
    ):  # vLLM's counters of drafts, draft tokens and accepted tokens
        out["spec_decode"] = {
            m.name.removeprefix("vllm:spec_decode_"): m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")
        }
    if beside is not None:
        beside.thread.join()
        out["beside_copy_seconds"] = beside.seconds
    print(json.dumps(out), flush=True)
    return 0


def dispatch(argv: list[str]) -> int:
    """Runs one command line's worth (the module docstring): an engine, or a writer."""
    from tests.support.tiny_models import (
        write_tiny_deepseek,
        write_tiny_eagle,
        write_tiny_gemma3,
        write_tiny_gpt_oss,
        write_tiny_llama,
        write_tiny_nemotron_h,
        write_word_tokenizer,
    )

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vllm-cpu's legacy variable (whole GiB) would override kv_cache_memory_bytes
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    writers = {
        "write-model": write_tiny_llama,
        "write-tokenizer": write_word_tokenizer,
        "write-mla-model": write_tiny_deepseek,
        "write-gemma3-model": write_tiny_gemma3,
        "write-eagle-model": write_tiny_eagle,
        "write-nemotron-h-model": write_tiny_nemotron_h,
        "write-gpt-oss-model": write_tiny_gpt_oss,
    }
    if argv[0] == "write-model":
        write_tiny_llama(argv[1], json.loads(argv[2]) if len(argv) > 2 else None)
    elif argv[0] == "write-nemotron-h-model":
        write_tiny_nemotron_h(argv[1], json.loads(argv[2]) if len(argv) > 2 else None)
    elif argv[0] in writers:
        writers[argv[0]](argv[1])
    else:
        return main(json.loads(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(dispatch(sys.argv[1:]))
