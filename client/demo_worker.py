"""The prefill and decode processes of ``kvstore demo``: ``python -m client.demo_worker``.

KV is synthetic but prefix-consistent like a real model's: the KV of a full block is a
function of that block's chained hash, the partial block's and the hidden states' of
the sequence hash. So a decode process can rebuild what it must receive and compare
every byte. Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import torch

from client import KVCacheClient
from kvstore import Namespace, block_hashes, sequence_hash

DEMO_NAMESPACE = dict(
    model="demo/llama-3-8b-shaped",
    dtype="float16",
    num_layers=32,
    num_kv_heads=8,
    head_size=128,
    block_size=16,
    hidden_size=4096,
)


def _seeded(h: bytes, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**63 - 1))
    return torch.randn(*shape, generator=g).to(torch.float16)


def synthetic_kv(
    ns: Namespace, tokens: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """key, value ``[layers, tokens, heads, head]`` and hidden ``[tokens, hidden]``."""
    L, H, D, B = ns.num_layers, ns.num_kv_heads, ns.head_size, ns.block_size
    hashes = block_hashes(ns, tokens)
    seq = sequence_hash(ns, tokens, hashes)
    blocks = [_seeded(h, 2, L, B, H, D) for h in hashes]
    partial = len(tokens) - len(hashes) * B
    blocks.append(_seeded(seq, 2, L, partial, H, D))
    kv = torch.cat(blocks, dim=2)
    return kv[0], kv[1], _seeded(seq[::-1], len(tokens), ns.hidden_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.demo_worker")
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument(
        "--tokens",
        required=True,
        help="comma-separated ranges start:stop; prefill: several prompts separated by ';'",
    )
    args = parser.parse_args(argv)
    prompts: list[list[int]] = []
    for prompt in args.tokens.split(";"):
        prompts.append([])
        for part in prompt.split(","):
            start, stop = map(int, part.split(":"))
            prompts[-1] += list(range(start, stop))
    tokens = prompts[0]
    ns = Namespace(**DEMO_NAMESPACE)
    key, value, hidden = synthetic_kv(ns, tokens)
    roi = torch.ones(len(tokens), dtype=torch.bool)
    with KVCacheClient(args.redis_url, ns, timeout=30) as client:
        t0 = time.perf_counter()
        if args.role == "prefill":
            totals: dict[str, int] = {}
            seconds = 0.0
            for tokens in prompts:  # each prompt's KV made before its clock starts
                key, value, hidden = synthetic_kv(ns, tokens)
                t0 = time.perf_counter()
                report = client.insert(
                    torch.tensor(tokens),
                    torch.ones(len(tokens), dtype=torch.bool),
                    key,
                    value,
                    hidden,
                )
                seconds += time.perf_counter() - t0
                for name, count in asdict(report).items():
                    totals[name] = totals.get(name, 0) + count
            out = {"tokens": sum(map(len, prompts)), "seconds": seconds, **totals}
        else:
            _, got_roi, k, v, h = client.select(torch.tensor(tokens), roi)
            seconds = time.perf_counter() - t0
            matched = 0 if got_roi is None else int(got_roi.sum())
            exact = matched == 0 or (
                torch.equal(k.view(torch.uint8), key[:, :matched].contiguous().view(torch.uint8))
                and torch.equal(
                    v.view(torch.uint8), value[:, :matched].contiguous().view(torch.uint8)
                )
                and (h is None or torch.equal(h.view(torch.uint8), hidden.view(torch.uint8)))
            )
            out = {
                "tokens": len(tokens),
                "matched": matched,
                "hidden": h is not None,
                "exact": bool(exact),
                "seconds": seconds,
                "bytes": client.stats.bytes_received,
            }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
