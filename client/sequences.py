"""insert/select: the lookup-buffer contract of vLLM's SimpleConnector, on top of the
paged mechanism: ``insert`` puts a ``PutPlan`` (``client.puts``), ``select`` reads a
``GetPlan`` of the sequence's pages into ``IntoSequence`` (``client.gets``: its handler
in ``client.gets.sequence_handler``), each through the handler of its pair.

A sequence's full blocks become shared, deduplicated pages (the paged API's); its
trailing partial block and hidden states go into a tail object of its own, keyed by the
sequence hash and split into parts (``client.codec``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from client import codec
from client.gets.plan import GetPlan, SequencePages
from client.gets.reads import PageReader
from client.gets.sequence_handler import IntoSequence
from client.lookups.prefix import Identity
from client.memory.buffers import split_spans
from client.puts.plan import FromSpans, Placed, PutPlan
from client.puts.publish import Outgoing, PublishReport
from client.puts.writes import PageWriter
from kvstore.errors import InvalidInputError
from kvstore.pages import heads, keys
from kvstore.pages.hashing import block_hashes, part_hashes, sequence_hash, token_array
from kvstore.pages.identity import resolve
from kvstore.pages.namespace import Namespace


class LookupBuffer:
    """One job: ``insert`` and ``select``, a whole sequence's KV in the caller's
    ``[layers, tokens, heads, head_size]`` tensors, over the parts of the paged
    mechanism it is given (``client.parts`` builds it): puts through the writer, gets
    through the reader, as plans. Pages move straight between the caller's key/value
    and the nodes (``codec.kv_spans``); only a rank that reads part of a head group
    receives units into a buffer and merges them. Runs on the client's event loop."""

    def __init__(
        self,
        namespace: Namespace,
        rank: heads.RankUnits,
        writer: PageWriter,
        reader: PageReader,
    ) -> None:
        self.namespace = namespace
        self._storage = namespace.storage
        self.heads = rank
        self._writer = writer
        self._reader = reader

    async def insert(
        self,
        input_tokens: Any,
        roi: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor | None = None,
        *,
        identity: Identity = None,
    ) -> PublishReport:
        """Store the KV of the tokens ``roi`` marks (a prefix of ``input_tokens``).

        Full blocks become shared, deduplicated pages; the trailing partial block and
        ``hidden`` go into the sequence's tail object. ``identity``: what else the KV
        depends on (adapter, salt, multimodal items, prompt embeddings); a ``select``
        under another identity never finds it."""
        tokens, n_all = self._roi_prefix(input_tokens, roi)
        T = len(tokens)
        ns = self.namespace
        self._whole_model("insert")
        key, value, hidden = (
            _token_prefix(t, T, n_all, dim) for t, dim in ((key, 1), (value, 1), (hidden, 0))
        )
        codec.check_kv(ns, "key", key, T)
        codec.check_kv(ns, "value", value, T)
        if hidden is not None:
            if ns.hidden_size == 0:
                raise InvalidInputError("hidden states given but the namespace has hidden_size=0")
            if tuple(hidden.shape) != (T, ns.hidden_size) or hidden.dtype != ns.torch_dtype():
                raise InvalidInputError(
                    f"hidden must be [{T}, {ns.hidden_size}] of {ns.torch_dtype()}, "
                    f"got {tuple(hidden.shape)} {hidden.dtype}"
                )
        extras = resolve(identity, ns.block_size, T)
        hashes = block_hashes(self._storage, tokens, extras)
        blocks = self._writer.publisher.unit_keys(hashes, "insert")
        key, value = (
            key.to("cpu").contiguous(),
            value.to("cpu").contiguous(),
        )  # no copy for contiguous host tensors
        spans = codec.kv_spans(ns, key, value, len(hashes), self.heads.count)
        tail = codec.encode_tail(ns, key, value, hidden)
        part_sizes = codec.tail_part_sizes(ns, T, hidden is not None)
        # the tail (partial block, hidden states) is this rank's own: keyed by its TP
        # namespace, a chain of its own in the index
        parts = part_hashes(sequence_hash(ns, tokens, hashes, extras), len(part_sizes))
        part_anchors, part_positions = keys.placement(parts)
        # one put: the blocks' units from the caller's key/value, the tail's parts from
        # its encoded buffer (spans of both, in the keys' order)
        placed = blocks + Outgoing(parts, [], part_anchors, part_positions)
        spans += split_spans(tail, part_sizes)
        return await self._writer.put(PutPlan(Placed(placed), FromSpans(spans)))

    async def select(self, input_tokens: Any, roi: Any, *, identity: Identity = None) -> list[Any]:
        """``[input_tokens, roi, key, value, hidden]`` for the longest stored prefix of the
        tokens ``roi`` marks: everything plus ``hidden`` when this exact sequence was
        inserted, else the longest block-aligned prefix with ``hidden=None``; five
        ``None`` on a miss. The returned ``roi`` marks the matched tokens; key and value
        are contiguous. ``identity``: the one the sequence was inserted under."""
        tokens, n_all = self._roi_prefix(input_tokens, roi)
        ns = self.namespace
        T = len(tokens)
        self._whole_model("select")
        extras = resolve(identity, ns.block_size, T)
        hashes = block_hashes(self._storage, tokens, extras)
        sizes_h = codec.tail_part_sizes(ns, T, ns.hidden_size > 0)
        sizes_nh = codec.tail_part_sizes(ns, T, False)
        parts = part_hashes(
            sequence_hash(ns, tokens, hashes, extras), max(len(sizes_h), len(sizes_nh))
        )
        plan = GetPlan(SequencePages(hashes, parts), IntoSequence(T))
        got = await self._reader.read(plan)
        if got is None:
            return [None] * 5
        kv = got.kv
        tail = None
        if got.blocks == len(hashes) and got.parts:
            flags = codec.read_tail_flags(got.tail)
            need = len(sizes_h if flags and flags[1] else sizes_nh)
            if flags and flags[0] == T and got.parts >= need:
                tail = codec.decode_tail(ns, got.tail[: sum(got.part_sizes[:need])])
        matched = T if tail is not None else got.blocks * ns.block_size
        if matched == 0:
            return [None] * 5
        hidden = None
        if tail is not None:
            kv[0, :, got.blocks * ns.block_size :] = tail.partial_key
            kv[1, :, got.blocks * ns.block_size :] = tail.partial_value
            hidden = tail.hidden
        elif matched < kv.shape[2]:
            # fewer blocks arrived than were found, or the tail did not: a shorter prefix
            kv = kv[:, :, :matched].contiguous()
        out_roi = torch.zeros(n_all, dtype=torch.bool)
        out_roi[:matched] = True
        return [input_tokens, out_roi, kv[0], kv[1], hidden]

    def _whole_model(self, call: str) -> None:
        """insert/select hold every layer of the model: a pipeline stage's namespace
        (``total_layers`` beyond its own) uses ``put_pages``/``get_pages``."""
        ns = self.namespace
        if ns.model_layers != ns.num_layers:
            raise InvalidInputError(
                f"{call} stores every layer; this namespace is a pipeline stage (layers {ns.first_layer} to "
                f"{ns.first_layer + ns.num_layers - 1} of {ns.model_layers}): use put_pages/get_pages"
            )

    @staticmethod
    def _roi_prefix(input_tokens: Any, roi: Any) -> tuple[np.ndarray, int]:
        """The tokens ``roi`` marks (which must be a prefix) and the total token count."""
        tokens = token_array(input_tokens)
        mask = np.asarray(roi.detach().cpu() if hasattr(roi, "detach") else roi)
        if mask.dtype != np.bool_ or mask.shape != tokens.shape:
            raise InvalidInputError(
                f"roi must be a bool mask shaped like input_tokens {tokens.shape}, got {mask.dtype} {mask.shape}"
            )
        m = int(mask.sum())
        if m == 0:
            raise InvalidInputError("roi marks no tokens")
        if not mask[:m].all():
            raise InvalidInputError(
                "roi must mark a prefix of the tokens (True values first, then only False)"
            )
        return tokens[:m], len(tokens)


def _token_prefix(t: Any, T: int, n_all: int, dim: int) -> Any:
    """Cut a per-token tensor given for all ``n_all`` tokens down to the ``T`` that roi marks."""
    if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == n_all != T:
        return t.narrow(dim, 0, T)
    return t
