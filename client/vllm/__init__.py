"""The vLLM v1 connector in parts. ``client.vllm_connector.KVStoreConnector`` is the
facade vLLM loads: it builds the side its role needs and delegates every method.

- ``options``: the connector's keys of ``kv_connector_extra_config``, the engine's
  namespace, per-request switches;
- ``metadata``: what the scheduler hands the workers each step (loads and saves);
- ``scheduler``: lookups, pending loads, the blocks of requests to save, the breaker;
- ``worker``: the paged cache, loader and saver threads, the staging pool;
- ``paged_cache``, ``breaker``, ``stats``: their tools."""
