"""The kvstore KV connector for vLLM's v1 connector API (KVConnectorBase_V1).

Load it with kv_connector="KVStoreConnector",
kv_connector_module_path="kvstore.connectors.vllm.connector": `transfer_settings` gives them.
"""

from __future__ import annotations


def transfer_settings(extra_config: dict) -> dict:
    """The fields of vLLM's KVTransferConfig (or `--kv-transfer-config`) that load this
    connector on every worker, with `extra_config` as its settings; a failed load recomputes."""
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra_config,
    }
