"""Fixtures of the fast connector tests over the memory store
(tests/vllm/test_scheduler_decisions.py, test_worker_decisions.py,
test_worker_head_groups.py): the stand-in model's config directory, and a fresh
``MemoryStore`` per test."""

from __future__ import annotations

import pytest

from tests.support.memory_store import MemoryStore
from tests.support.stand_in_model import write_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("tiny-llama-config"))


@pytest.fixture()
def store() -> MemoryStore:
    return MemoryStore()
