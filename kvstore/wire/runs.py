"""Which pages travel in one message: the client's side of the rule (``may_share``,
sent as a request's ``join``) and the node's (``group_runs``, on PUT and GET)."""

from __future__ import annotations

# A get's largest run unless the client asks for another (GetRequest.max_run_bytes).
DEFAULT_MAX_RUN_BYTES = 64 << 20
# Pages below this size may share a message even when they do not touch in the
# client's memory: one copy through a scratch buffer costs less than a message each.
PACK_BELOW = 256 << 10


def may_share(touching: bool, prev_nbytes: int, nbytes: int, scattered: bool = False) -> bool:
    """The client's side of the rule: a page may travel in one message with the page
    before it when the two touch in the client's memory, when both are scattered
    (each in pieces, as a block of a layer-major paged cache: they go through a
    scratch buffer either way), or when both are below ``PACK_BELOW`` (packed through
    a scratch buffer). Sent as a request's ``join``. Measured for scattered pages, a
    UCX get of 96 pages of 1.25 MiB into a 10-layer cache (the TTFT bench's load),
    medians of 10 gets per process: 57.0-68.2 ms over 5 processes with a message per
    page, 45.1-59.3 ms over 9 sharing messages of up to 64 MiB (16 MiB runs: no better)."""
    return touching or scattered or (nbytes < PACK_BELOW and prev_nbytes < PACK_BELOW)


def group_runs(
    offsets: list[int], sizes: list[int], join: list[bool], indexes: list[int], max_run_bytes: int
) -> list[int]:
    """Group the pages a node sends or receives into runs that travel as one message
    each: the whole rule, applied by the node on both PUT and GET.

    Page k (request item ``indexes[k]``, pool slot ``offsets[k]``) joins page k-1's run
    when the client allowed it (``join[k]``, see ``may_share``), its request predecessor
    is in the run too (a page skipped in between breaks adjacency in the client's
    memory) unless both are small enough to be packed anyway, their pool slots touch,
    and the run stays within ``max_run_bytes``."""
    runs: list[int] = []
    run_len, run_bytes = 0, 0
    for k, (off, size) in enumerate(zip(offsets, sizes)):
        small = k > 0 and size < PACK_BELOW and sizes[k - 1] < PACK_BELOW
        allowed = k > 0 and join[k] and (indexes[k - 1] == indexes[k] - 1 or small)
        joins = (
            run_len > 0
            and allowed
            and offsets[k - 1] + sizes[k - 1] == off
            and run_bytes + size <= max_run_bytes
        )
        if joins:
            run_len += 1
            run_bytes += size
        else:
            if run_len:
                runs.append(run_len)
            run_len, run_bytes = 1, size
    if run_len:
        runs.append(run_len)
    return runs
