"""Which prefix lengths a hybrid model's side pool can restore (``restorable_ends``),
by SGLang's per-pool hit policies (``PoolHitPolicy`` in SGLang's hicache_storage.py,
named here by their values so that this imports nothing of SGLang). The backend's
``batch_exists_v2`` asks it once per side pool."""

from __future__ import annotations

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
SERVED_POLICIES = (ALL_PAGES, TRAILING_PAGES)


def restorable_ends(present: list[bool], policy: str, window: int) -> list[int]:
    """The prefix lengths (in pages, from 1) a side pool can restore, from which of its
    pages are stored (``present``, per KV page of the prefix), by SGLang's hit policy:
    ``all_pages``, every page up to the length; ``trailing_pages``, the last ``window``
    pages before it (a Mamba state: one page; a sliding window: several; fewer where
    the prefix is shorter). SGLang intersects these lengths over pools and TP ranks. A
    policy not served (``block_groups``, DeepSeek V4's compressed pools) restores none."""
    if policy == ALL_PAGES:
        end = present.index(False) if False in present else len(present)
        return list(range(1, end + 1))
    if policy == TRAILING_PAGES:
        run, ends = 0, []  # run: the stored pages that end at each position
        for i, stored in enumerate(present):
            run = run + 1 if stored else 0
            if run >= min(window, i + 1):
                ends.append(i + 1)
        return ends
    return []
