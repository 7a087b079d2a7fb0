"""The kvstore KV connector for vLLM's v1 connector API (KVConnectorBase_V1).

Load it with kv_connector="KVStoreConnector",
kv_connector_module_path="kvstore.connectors.vllm.connector".
"""
