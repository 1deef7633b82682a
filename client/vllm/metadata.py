"""What the scheduler side hands the worker side each engine step: vLLM's metadata
holding the engine-neutral specs of ``client.paging.specs``."""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # the load path without vLLM (bench/gpu_check.py on a GPU host)
    KVConnectorMetadata = object  # type: ignore[misc,assignment]

from client.paging.specs import AwaitedLoad, GatherSpec, LoadSpec, SaveSpec
from client.vllm.pins import PinSpec
from client.vllm.states import StateSpec

__all__ = [
    "AwaitedLoad",
    "GatherSpec",
    "KVStoreConnectorMetadata",
    "LoadSpec",
    "PinSpec",
    "SaveSpec",
    "StateSpec",
]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    # loads of prefixes a prefill engine announced (P/D), waited for before loading
    awaited: list[AwaitedLoad] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    gathers: list[GatherSpec] = field(default_factory=list)
    states: list[StateSpec] = field(default_factory=list)  # boundary states to save
    # prefixes to pin once the saves handed over before them are published
    pins: list[PinSpec] = field(default_factory=list)
    # requests whose gathered pages will not be saved
    dropped: list[str] = field(default_factory=list)
    idle: bool = False  # the step computes nothing: the engine only waits for transfers
