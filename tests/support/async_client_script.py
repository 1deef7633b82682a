"""AsyncKVCacheClient on the caller's own event loop: ``python tests/support/async_client_script.py URL``.

Prints one JSON line (a separate process, so UCX is driven only by this loop)."""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from client import AsyncKVCacheClient
from tests.support.helpers import kv_for, pages_for


async def main(url: str) -> dict:
    fields = dict(
        model="async-test",
        dtype="float16",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        block_size=16,
        hidden_size=64,
    )
    async with AsyncKVCacheClient(url, replicas=2, **fields) as client:
        ns = client.namespace
        tokens = list(range(5 * 16 + 3))
        key, value, hidden = kv_for(ns, tokens)
        roi = torch.ones(len(tokens), dtype=torch.bool)
        report = await client.insert(torch.tensor(tokens), roi, key, value, hidden)
        _, got_roi, k, v, h = await client.select(torch.tensor(tokens), roi)
        pages = pages_for(ns, tokens)
        out = torch.empty_like(pages)
        concurrent = await asyncio.gather(client.lookup(tokens), client.get_pages(tokens, out))
        exact = all(
            torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
            for a, b in ((k, key), (v, value), (h, hidden))
        )
        return {
            "sent": report.sent,
            "matched": int(got_roi.sum()),
            "exact": exact,
            "lookup": concurrent[0],
            "pages": concurrent[1],
            "pages_exact": torch.equal(out.view(torch.uint8), pages.view(torch.uint8)),
        }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
