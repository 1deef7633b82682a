"""``kvstore pd-proxy``'s choices, without servers: what a prefill is sent, which server
takes a request, and the URLs it accepts (tests/vllm/test_vllm_pd_serve.py runs it between
real vLLM servers)."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidInputError
from kvstore.tools.pd_proxy import Backend, parse_urls, pick, prefill_body, prompt_key


def test_a_prefill_is_asked_for_one_token_unstreamed_and_to_hand_over():
    body = {
        "prompt": "t5 t6",
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    sent = prefill_body(body)
    assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1
    assert sent["stream"] is False and "stream_options" not in sent
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert sent["kv_transfer_params"]["do_remote_prefill"] is False
    assert sent["temperature"] == 0 and body["max_tokens"] == 50  # the caller's body is kept


def test_the_least_loaded_server_is_picked_and_ties_follow_the_prompt():
    servers = [Backend(f"http://h{i}:8000") for i in range(4)]
    servers[0].in_flight = servers[1].in_flight = 1
    assert pick(servers, "a").url in {"http://h2:8000", "http://h3:8000"}
    for s in servers:
        s.in_flight = 0
    # the same prompt start meets the same server; prompts spread over all of them
    assert len({pick(servers, "same prefix").url for _ in range(10)}) == 1
    assert len({pick(servers, f"prompt {i}").url for i in range(64)}) == 4
    chat = {"messages": [{"role": "user", "content": "x" * 2000}]}
    assert len(prompt_key(chat)) == 512 and prompt_key({"prompt": "abc"}) == "abc"


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "--decode names no server"), ("localhost:8000", "is not an http:// or https:// URL")],
)
def test_urls_that_are_not_http_are_refused_by_name(text, message):
    with pytest.raises(InvalidInputError, match=message):
        parse_urls(text, "decode")
    assert [b.url for b in parse_urls("http://a:1/, https://b:2", "decode")] == [
        "http://a:1",
        "https://b:2",
    ]
