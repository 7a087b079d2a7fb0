"""The kvstore storage backend for SGLang's HiCache (`HiCacheStorage`, the L3 tier).

Load it with --hicache-storage-backend dynamic and extra config
{"backend_name":"kvstore","module_path":"kvstore.connectors.sglang.backend",
 "class_name":"KVStoreHiCacheStorage","interface_v1":1,"socket_path":...}.
"""
