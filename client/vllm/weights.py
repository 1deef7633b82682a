"""Which weights an engine's KV comes from (``Namespace.weights``): the operator's name
for them, or a fingerprint of the checkpoint's files. Read by both sides of the
connector when they build their namespaces (``client.vllm.options``, ``client.vllm.drafts``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvstore.pages.weights import fingerprint
from kvstore.settings.client import ClientOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("client.vllm.options")


def engine_weights(vllm_config: VllmConfig, options: ClientOptions) -> str:
    """Which weights this engine's KV comes from (``Namespace.weights``): the operator's
    ``weights_revision`` when set, else a fingerprint of the checkpoint's files
    (``kvstore.pages.weights``: milliseconds at start, the same on every machine
    holding the same files), with the runtime quantization when there is one (the same
    files quantized on load compute other KV). A model that is neither a local
    checkpoint nor one in the local hub cache is named by id and revision, and said so."""
    if options.weights_revision:
        return options.weights_revision
    model = vllm_config.model_config
    found = checkpoint_fingerprint(model.model, model.revision)
    if found is None:
        found = f"id:{model.model}@{model.revision or 'default'}"[:200]
        log.warning(
            "KVStoreConnector: cannot read the checkpoint of %s to fingerprint it; its pages are keyed by model id and "
            "revision only: set weights_revision in kv_connector_extra_config when the weights change under that name",
            model.model,
        )
    quantization = getattr(model, "quantization", None)
    return f"{found} quant:{quantization}" if quantization else found


def checkpoint_fingerprint(model_id: str, revision: str | None) -> str | None:
    """The fingerprint of a local checkpoint, or of one in the local Hugging Face
    cache; None when neither holds ``model_id``."""
    return fingerprint(model_id) or _hub_fingerprint(model_id, revision)


def _hub_fingerprint(model_id: str, revision: str | None) -> str | None:
    """The fingerprint of ``model_id``'s snapshot in the local Hugging Face cache; None
    when it is not there (nothing is downloaded)."""
    try:
        from huggingface_hub import snapshot_download

        return fingerprint(snapshot_download(model_id, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, not cached, no huggingface_hub: no fingerprint
        return None
