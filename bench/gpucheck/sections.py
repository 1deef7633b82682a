"""The GPU check's sections in order, with the title each prints and whether it needs the
local store; bench/gpu_check.py runs them. Importing it imports torch (the sections' modules)."""

from __future__ import annotations

from bench.gpucheck.breakdown import section_breakdown
from bench.gpucheck.layerwise import section_layerwise
from bench.gpucheck.loads import section_h2d, section_ucx
from bench.gpucheck.save import section_save, section_tests

SECTIONS = [
    (
        "1. Same-host loads into device memory (goals: >= 0.8x the pinned copy at 2 and 16 MiB, >= 0.5x at 64 KiB)",
        section_h2d,
        True,
    ),
    (
        "2. UCX: gets into device memory (goal: at least the rate into host memory)",
        section_ucx,
        True,
    ),
    ("3. Layer-wise loading: time to first token", section_layerwise, False),
    (
        "4. Save path: a save in flight against decode steps (goals: call <= 1 ms, first step <= 1.2x)",
        section_save,
        False,
    ),
    ("5. tests: paged cache, device checksums, device loads", section_tests, False),
    ("6. Where a same-host device load's time goes", section_breakdown, True),
]
