"""The connector's configuration checked when vLLM first imports it, before any model loads.

vLLM 0.32 builds connectors only after the model has loaded and its KV cache is laid
out (the workers' ``initialize_from_config``, then the scheduler), so a configuration
the connector cannot use stopped the engine a minute in, at the end of some 190 lines
of traceback. vLLM does import the connector's module much earlier: ``VllmConfig``'s
``__post_init__`` asks whether the named connector supports the hybrid KV-cache manager
(``KVConnectorFactory.supports_hma_config``), in the process that parses the command
line (``vllm serve``'s API server, or the process calling ``LLM(...)``). vLLM hands the
connector nothing at that point, so ``check_config_being_built`` finds the config being
built on the call stack and validates the connector's part of it the way the connector
will (``connector_options``: the JSON, then the ``KVSTORE_*`` variables).

Only what can be decided without the network is checked here: no index URL anywhere,
an option that does not validate. An unreachable index or a refused token is not an
error at start; the engine serves, and the connector counts misses.

Where the config is not on the stack (vLLM asked nothing at config time because
``--disable-hybrid-kv-cache-manager`` was given, or the module had been imported
before), the same check runs when the connector is built, as it always did."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from client.vllm.options import connector_options
from kvstore.errors import InvalidInputError

if TYPE_CHECKING:
    from types import FrameType

    from vllm.config import VllmConfig

CONNECTOR = "KVStoreConnector"
MAX_FRAMES = 40  # the config's __post_init__ is about 10 frames above the import


def config_being_built(frame: FrameType | None) -> VllmConfig | None:
    """The ``VllmConfig`` whose construction is on the stack above ``frame``, if any."""
    from vllm.config import VllmConfig

    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        if frame.f_code.co_name == "__post_init__":
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, VllmConfig):
                return candidate
        frame = frame.f_back
    return None


def config_error(vllm_config: VllmConfig) -> str | None:
    """Why this engine's connector configuration cannot work, in one line naming the
    connector; None when it can (or when the engine does not name this connector)."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None or transfer.kv_connector != CONNECTOR:
        return None
    try:
        connector_options(dict(transfer.kv_connector_extra_config or {}))
    except InvalidInputError as exc:
        message = str(exc)
        return message if message.startswith(CONNECTOR) else f"{CONNECTOR}: {message}"
    return None


def check_config_being_built() -> None:
    """Called once, by ``client.vllm_connector`` as vLLM imports it. Where a config is
    being built and the connector cannot work with it, stop the process with that one
    line (``SystemExit``: Python prints the line and no traceback; a program that builds
    engines itself can catch it) before any model loads."""
    vllm_config = config_being_built(sys._getframe(1))
    if vllm_config is None:
        return
    error = config_error(vllm_config)
    if error is not None:
        raise SystemExit(error)
