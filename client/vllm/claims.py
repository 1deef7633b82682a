"""The decode scheduler's side of a P/D handoff: claims of the prefixes prefill engines
announced (``client.vllm.transfer_params``), from ``get_num_new_matched_tokens`` until
``build_connector_meta`` hands them to the workers (``client.vllm.remote_prefill``).

Used by ``client.vllm.scheduler.ConnectorScheduler`` on the engine's scheduler thread."""

from __future__ import annotations

from typing import TYPE_CHECKING

from client.paging.specs import AwaitedLoad
from client.vllm.identity import KeyedPrompt
from client.vllm.stats import StatsRecorder
from client.vllm.transfer_params import announced

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


class AnnouncedClaims:
    """Per request, the announced prefix claimed and not yet handed over, and the
    requests whose announcement could not be used (counted once). ``wait_s``: how long
    a worker waits for the pages."""

    def __init__(self, block_size: int, wait_s: float, stats: StatsRecorder) -> None:
        self._block_size = block_size
        self._wait_s = wait_s
        self._stats = stats
        self._claimed: dict[str, AwaitedLoad] = {}
        self._unusable: set[str] = set()

    def claim(
        self, request: Request, keyed: KeyedPrompt, usable: int, computed: int
    ) -> tuple[int, bool] | None:
        """``get_num_new_matched_tokens``'s answer for a request whose prefill announced
        its prefix: the announced blocks past ``computed`` at once, loaded
        asynchronously once the workers find them stored, with no lookup here (at most
        ``usable`` tokens: one prompt token is always computed); None when the request
        announces nothing this engine can wait for (it is looked up as any other)."""
        req_id = request.request_id
        claimed = self._claimed.get(req_id)
        if claimed is None:
            if req_id in self._unusable:
                return None
            said = announced(
                request.kv_transfer_params, self._block_size, keyed.tokens, keyed.extras, req_id
            )
            if said is None:
                return None
            if not said.usable:
                self._unusable.add(req_id)
                self._stats.count(remote_prefill_mismatches=1)
                return None
            blocks = min(said.blocks, usable // self._block_size)
            tokens = keyed.tokens[: blocks * self._block_size]
            claimed = AwaitedLoad(req_id, tokens, keyed.extras, [], 0, self._wait_s)
            self._claimed[req_id] = claimed
            self._stats.count(remote_prefills_announced=1)
        new = len(claimed.tokens) - computed
        if new <= 0:
            return 0, False
        claimed.start_block = computed // self._block_size
        return new, True

    def allocated(self, request: Request, blocks: KVCacheBlocks, external: int) -> bool:
        """``update_state_after_alloc`` for a claimed request (False: not one): its
        blocks, or the claim dropped when vLLM took none of its tokens."""
        claimed = self._claimed.get(request.request_id)
        if claimed is None:
            return False
        if external == 0:
            del self._claimed[request.request_id]
        else:
            count = len(claimed.tokens) // self._block_size
            claimed.block_ids = list(blocks.get_block_ids()[0])[:count]
        return True

    def take_allocated(self) -> list[AwaitedLoad]:
        """The claims with blocks, handed to the workers now (each once)."""
        ready = [c for c in self._claimed.values() if c.block_ids]
        for claimed in ready:
            del self._claimed[claimed.req_id]
        return ready

    def forget(self, req_id: str) -> None:
        self._claimed.pop(req_id, None)
        self._unusable.discard(req_id)
