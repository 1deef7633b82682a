"""The control fan-out (kvstore/control/caller.py) against HTTP endpoints that answer
as nodes answer, in this process: how each kind of answer lands in the report or the
error (the real nodes' answers are tested in tests/client/test_control_calls.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvstore.control.caller import ControlCaller
from kvstore.control.requests import ClearRequest, PinRequest, PrefixRequest
from kvstore.errors import CredentialError, InvalidInputError, PinRefusedError
from kvstore.index import NodeInfo
from kvstore.tools.procutil import free_port

HASH = "0123456789abcdef0123456789abcdef"
PIN = PinRequest(namespace=HASH, block_hashes=[HASH, HASH], tenant="team-a", ttl_s=9)


class Endpoint:
    """An HTTP server answering every POST with ``answer`` (status, body), keeping
    what it was sent."""

    def __init__(self) -> None:
        self.answer: tuple[int, bytes] = (200, b"{}")
        self.seen: list[tuple[str, dict, str]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                endpoint.seen.append(
                    (self.path, json.loads(body), self.headers.get("Authorization", ""))
                )
                status, out = endpoint.answer
                self.send_response(status)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def node(self, node_id: str) -> NodeInfo:
        return NodeInfo(node_id, "127.0.0.1:1", 1, "inc", extra={"metrics": self.address})

    def answers(self, status: int, doc: object) -> None:
        self.answer = (status, json.dumps(doc).encode())


@pytest.fixture()
def endpoints() -> Iterator[list[Endpoint]]:
    made = [Endpoint() for _ in range(3)]
    yield made
    for e in made:
        e.server.shutdown()
        e.server.server_close()


def action(node_id: str, pages: int, **more: int) -> dict:
    return {"node_id": node_id, "action": "pin", "pages": pages, "bytes": pages * 4096, **more}


def test_every_node_is_asked_with_the_token_and_the_answers_add_up(endpoints):
    a, b, c = endpoints
    a.answers(200, action("a", 2, memory=1, disk=1, blocks=2))
    b.answers(200, action("b", 2, memory=2, missing=0, blocks=2))
    c.answers(200, action("c", 0, missing=2))
    nodes = [a.node("a"), b.node("b"), c.node("c")]
    report = ControlCaller(lambda: nodes, "secret").call("/v1/kv/pin", PIN)
    assert (report.action, report.pages, report.bytes) == ("pin", 4, 4 * 4096)
    assert (report.memory, report.disk, report.missing) == (3, 1, 2)
    assert [n.node_id for n in report.nodes] == ["a", "b", "c"] and not report.unreachable
    for e in endpoints:
        path, body, auth = e.seen[0]
        assert path == "/v1/kv/pin" and auth == "Bearer secret"
        assert body == {
            "tenant": "team-a",
            "namespace": HASH,
            "block_hashes": [HASH, HASH],
            "ttl_s": 9,
        }


def test_nodes_that_cannot_answer_are_named_unreachable_and_left_out(endpoints):
    a, b, c = endpoints
    a.answers(200, action("a", 3))
    b.answers(503, {"error": "the index could not answer: gone"})
    c.answer = (200, b"not json")
    nodes = [
        a.node("a"),
        b.node("b"),
        c.node("c"),
        NodeInfo("no-port", "127.0.0.1:1", 1, "inc"),
        NodeInfo(
            "refusing", "127.0.0.1:1", 1, "inc", extra={"metrics": f"127.0.0.1:{free_port()}"}
        ),
    ]
    report = ControlCaller(lambda: nodes).call(
        "/v1/kv/unpin", PrefixRequest(**PIN.model_dump(exclude={"ttl_s"}))
    )
    assert report.pages == 3 and [n.node_id for n in report.nodes] == ["a"]
    why = report.unreachable
    assert set(why) == {"b", "c", "no-port", "refusing"}
    assert "503" in why["b"] and "the index could not answer" in why["b"]
    assert "not json" in why["c"]
    assert "no metrics port" in why["no-port"]
    assert "refused" in why["refusing"].lower()
    assert a.seen[0][2] == ""  # no token: no Authorization header


def test_a_refused_token_raises_naming_the_nodes_and_the_tenant(endpoints):
    a, b, _ = endpoints
    a.answers(200, action("a", 1))
    b.answers(403, {"error": "credential x may not change pages of tenant team-a"})
    with pytest.raises(CredentialError) as exc:
        ControlCaller(lambda: [a.node("a"), b.node("b")], "t").call("/v1/kv/pin", PIN)
    assert exc.value.node_ids == ["b"] and exc.value.tenant == "team-a"
    assert "may not change pages" in str(exc.value) and "KVSTORE_AUTH_TOKEN" in str(exc.value)


def test_a_bad_request_raises_invalid_input_with_the_nodes_reason(endpoints):
    a = endpoints[0]
    a.answers(400, {"error": "invalid request: block_hashes: too many"})
    with pytest.raises(InvalidInputError, match="node a .invalid request: block_hashes: too many"):
        ControlCaller(lambda: [a.node("a")]).call("/v1/kv/clear", ClearRequest(tenant="t"))


def test_a_pin_a_node_refuses_raises_once_all_answered_and_the_other_pins_stand(endpoints):
    a, b, c = endpoints
    a.answers(200, action("a", 2))
    b.answers(409, {"error": "pinning 8 more bytes would pin ... (--pin-max-share)"})
    c.answers(409, {"error": "tenant team-a would pin ... (--tenant-quota)"})
    nodes = [a.node("a"), b.node("b"), c.node("c")]
    with pytest.raises(PinRefusedError) as exc:
        ControlCaller(lambda: nodes).call("/v1/kv/pin", PIN)
    err = exc.value
    assert set(err.refusals) == {"b", "c"} and "--tenant-quota" in err.refusals["c"]
    assert (
        "node b (" in str(err)
        and "--pin-max-share" in str(err)
        and "the pins of a stand" in str(err)
    )
    assert err.accepted.pages == 2 and [n.node_id for n in err.accepted.nodes] == ["a"]
    assert all(len(e.seen) == 1 for e in endpoints)  # every node was asked


def test_a_body_of_the_wrong_kind_or_path_is_refused_before_asking(endpoints):
    caller = ControlCaller(lambda: [endpoints[0].node("a")])
    with pytest.raises(InvalidInputError, match="takes a PinRequest"):
        caller.call("/v1/kv/pin", ClearRequest(tenant="t"))
    with pytest.raises(InvalidInputError, match="no control path"):
        caller.call("/v1/kv/evict", PIN)
    assert not endpoints[0].seen


def test_where_asks_the_query_with_residency_and_merges_the_tables(endpoints):
    a, b, _ = endpoints
    other = "f" * 32

    def answer(blocks: list[dict]) -> dict:
        return {
            "model": None,
            "tokens": 48,
            "blocks": 3,
            "answered_by": "x",
            "namespaces": [{"namespace": HASH, "blocks": 3, "tokens": 48, "residency": blocks}],
        }

    a.answers(
        200,
        answer(
            [
                {"block": 0, "tier": "CPU", "pinned": True, "pin_ttl_s": 30.5},
                {"block": 2, "tier": "DISK", "pinned": True, "pin_ttl_s": 12.0},
            ]
        ),
    )
    b.answers(200, answer([{"block": 2, "tier": "CPU"}, {"block": 1, "tier": "CPU"}]))
    caller = ControlCaller(lambda: [a.node("a"), b.node("b")], "t")
    body = PrefixRequest(namespace=HASH, block_hashes=[HASH] * 3, tenant="team-a")
    report = caller.where(body)
    path, sent, _ = a.seen[0]
    assert path == "/v1/kv/query_by_hash"
    assert sent == {
        "block_hashes": [HASH] * 3,
        "namespace": HASH,
        "tenant": "team-a",
        "residency": True,
    }
    assert report.stored == {HASH: 3} and not report.unreachable
    assert [b.block for b in report.residency["b"][HASH]] == [1, 2]  # in block order
    holders = report.holders()[HASH]
    assert {blk: [h.node_id for h in hs] for blk, hs in holders.items()} == {
        0: ["a"],
        1: ["b"],
        2: ["a", "b"],
    }
    assert holders[2][0].tier == "DISK" and holders[2][1].tier == "CPU"
    rows = {r.node_id: r for r in report.summary()}
    assert (rows["a"].memory, rows["a"].disk, rows["a"].pinned, rows["a"].shortest_ttl_s) == (
        1,
        1,
        2,
        12.0,
    )
    assert (rows["b"].memory, rows["b"].disk, rows["b"].pinned, rows["b"].shortest_ttl_s) == (
        2,
        0,
        0,
        None,
    )
    # the token form goes to /v1/kv/query with the adapter, salt and block size
    caller.where(
        PrefixRequest(model="m", token_ids=[1, 2], lora_name="l", block_size=16, namespace=other)
    )
    path, sent, _ = a.seen[1]
    assert path == "/v1/kv/query"
    assert sent == {
        "model": "m",
        "token_ids": [1, 2],
        "lora_name": "l",
        "block_size": 16,
        "tenant": "default",
        "residency": True,
    }


def test_no_live_node_is_an_empty_report():
    report = ControlCaller(lambda: []).call(
        "/v1/kv/prefetch", PrefixRequest(model="m", token_ids=[1])
    )
    assert report.pages == 0 and report.nodes == [] and report.unreachable == {}
