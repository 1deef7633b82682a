"""A separate client process for tests: ``python tests/worker.py '<json spec>'``.

Prints one JSON line with what it did and whether every byte it read was right."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

import torch

from client import KVCacheClient
from kvstore import Namespace
from tests.helpers import kv_for, pages_for


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (random page bytes include NaNs, which torch.equal rejects)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def tokens_of(spec: dict) -> list[int]:
    return spec["tokens"] if "tokens" in spec else list(range(spec.get("start", 0), spec.get("start", 0) + spec["count"]))


def main() -> int:
    spec = json.loads(sys.argv[1])
    ns = Namespace(**spec["namespace"])
    options = spec.get("options", {})
    client = KVCacheClient(spec["redis_url"], ns, **options)
    out: dict = {"op": spec["op"]}
    t0 = time.perf_counter()
    if spec["op"] == "put_pages":
        for tokens in (spec["token_lists"] if "token_lists" in spec else [tokens_of(spec)]):
            report = client.put_pages(tokens, pages_for(ns, tokens))
            out.setdefault("reports", []).append(asdict(report))
    elif spec["op"] == "get_pages":
        results = []
        deadline = time.monotonic() + spec.get("loop_seconds", 0)
        while True:
            for tokens in (spec["token_lists"] if "token_lists" in spec else [tokens_of(spec)]):
                expected = pages_for(ns, tokens)
                buf = torch.empty_like(expected)
                n = client.get_pages(tokens, buf) // ns.block_size
                results.append({"blocks": len(expected), "matched": n, "exact": same_bytes(buf[:n], expected[:n])})
            if time.monotonic() >= deadline:
                break
        out["results"] = results
    elif spec["op"] == "insert":
        tokens = tokens_of(spec)
        key, value, hidden = kv_for(ns, tokens)
        report = client.insert(torch.tensor(tokens), torch.ones(len(tokens), dtype=torch.bool), key, value, hidden if spec.get("hidden", True) else None)
        out["report"] = asdict(report)
    elif spec["op"] == "select":
        tokens = tokens_of(spec)
        key, value, hidden = kv_for(ns, tokens)
        res = client.select(torch.tensor(tokens), torch.ones(len(tokens), dtype=torch.bool))
        if res[0] is None:
            out.update(matched=0, exact=True, hidden=False)
        else:
            m = int(res[1].sum())
            exact = same_bytes(res[2], key[:, :m]) and same_bytes(res[3], value[:, :m])
            if res[4] is not None:
                exact = exact and same_bytes(res[4], hidden)
            out.update(matched=m, exact=bool(exact), hidden=res[4] is not None)
    out["seconds"] = time.perf_counter() - t0
    out["stats"] = client.stats.as_dict()
    client.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
