"""kvstore as LMCache's shared tier: an L2 adapter of LMCache's multiprocess cache server
(`lmcache server`) that keeps LMCache's chunks in the host's kvstore node agent, so every
LMCache server of the cluster finds them through kvstore's metadata service.

Load it with `lmcache server ... --l2-adapter '{"type":"plugin",
"module_path":"kvstore.connectors.lmcache.adapter","class_name":"KVStoreL2Adapter",
"adapter_params":{"socket_path":"/run/kvstore/agent.sock"}}'`.
"""
