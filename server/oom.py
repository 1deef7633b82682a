"""The node's standing with the kernel's OOM killer.

A node's page memory is shared memory reserved at start, so on a host (or in a pod)
whose memory runs out the node is often the largest process, the one the OOM killer
picks, though losing it costs every engine its cached prefixes while an engine's
scratch process is cheap to lose. ``--oom-score-adj`` (called once by
``server/__main__.py`` before the pool is faulted in) moves it down the kernel's list.
Kubernetes sets the score itself from the pod's QoS class (Guaranteed: -997), which is
what the Helm chart relies on (docs/operations.md)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PATH = "/proc/self/oom_score_adj"


def set_oom_score_adj(score: int, path: str = PATH) -> bool:
    """Write ``score`` (-1000..1000) for this process; True when the kernel took it. A
    refusal (lowering needs root or CAP_SYS_RESOURCE) is one warning, never a failure:
    the node serves as it would have without the option."""
    try:
        with open(path, "w") as f:
            f.write(str(score))
    except OSError as exc:
        log.warning(
            "could not set oom_score_adj to %d (%s): the node runs with the inherited one",
            score,
            exc,
        )
        return False
    log.info("oom_score_adj set to %d", score)
    return True
