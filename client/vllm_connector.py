"""The module path vLLM configs name (``kv_connector_module_path="client.vllm_connector"``,
README): the connector itself is ``client.vllm.connector.KVStoreConnector``, and either
path works."""

from client.vllm.connector import KVStoreConnector, KVStoreConnectorMetadata

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]
