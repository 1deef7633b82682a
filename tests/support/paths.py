"""Where things are: the checkout's root, which every path a test names starts from,
and the folder beside the virtualenv where CI installs Triton (.ci/run)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRITON_SITE = os.environ.get("KVSTORE_TRITON_SITE", str(ROOT / ".venv" / "triton-site"))
