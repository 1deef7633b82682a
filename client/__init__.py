"""Client library of the KV-cache store: ``KVCacheClient`` (blocking) and
``AsyncKVCacheClient`` (asyncio), plus the vLLM connector in ``client.vllm``
(``client.vllm_connector`` for vLLM configs)."""

from client.async_client import AsyncKVCacheClient
from client.lookups.stored_prefix import StoredPrefix
from client.puts.publish import PublishReport
from client.sync_client import KVCacheClient

__all__ = ["AsyncKVCacheClient", "KVCacheClient", "PublishReport", "StoredPrefix"]
