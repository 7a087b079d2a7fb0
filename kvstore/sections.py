"""The settings sections of the `kvstore` processes: the metadata service's ([metadata],
KVSTORE_METADATA_*) and the node agent's ([node], KVSTORE_NODE_*). Their dataclasses declare
each setting's type and default; here is the rest of its declaration (help, flag, choices).

Imported by the CLI (kvstore/cli.py) in the user's shell process.
"""

from __future__ import annotations

from kvstore.config import Section
from kvstore.metadata.server.server import BACKENDS, MetadataConfig
from kvstore.node.agent import NodeConfig
from kvstore.settings import Spec

_ACCOUNT = "NAMESPACE/NAME"


def _flag(help: str, **spec) -> Spec:
    """A setting the command line takes, as --its-name."""
    return Spec(help, flag=True, **spec)


METADATA = Section(
    MetadataConfig,
    "metadata",
    {
        "listen": _flag("gRPC host:port"),
        "backend": _flag("where the index lives", choices=BACKENDS),
        "insecure_no_auth": _flag(
            "listen beyond loopback without --token-file: anyone who reaches it may read and "
            "publish every tenant's keys"
        ),
        "redis_url": _flag("redis://host:port/db; redis-cluster: redis://h1:p1,h2:p2"),
        "redis_wait_replicas": _flag("WAIT for N replicas after each write", ge=0),
        "redis_wait_timeout_ms": _flag("WAIT timeout", ge=0),
        "redis_shards": _flag(
            "shards of the index over the cluster's masters, one hash tag each; 0: 4 per master "
            "on a cluster, 1 on a standalone server; changing it revokes every lease (agents "
            "republish)",
            ge=0,
        ),
        "data_dir": _flag("where LMDB keeps the index"),
        "token_file": _flag("'TOKEN TENANT [node=NODE_ID]' lines; enables auth"),
        "kube_agent_service_account": _flag(
            "accept this service account's projected tokens (audience kvstore), each acting as "
            "the node its pod runs on (TokenReview; enables auth)",
            metavar=_ACCOUNT,
        ),
        "kube_sidecar_service_account": _flag(
            "the same for sidecar agents, each acting as its pod's name", metavar=_ACCOUNT
        ),
        "tls_cert": _flag("server certificate (PEM)"),
        "tls_key": _flag("its private key (PEM)"),
        "tls_client_ca": _flag("require client certificates signed by this CA"),
        "key_quota_per_tenant": _flag("keys one tenant may hold; 0: unlimited"),
        "max_watch_streams_per_tenant": _flag("WatchEvents streams per tenant"),
        "max_watch_streams_all_tenants": _flag(
            "WatchEvents streams of all-tenant tokens: node agents hold one each"
        ),
        "max_lookup_streams_per_tenant": _flag(
            "LookupStream calls per tenant token: a client holds one per concurrent lookup"
        ),
        "max_lookup_streams_all_tenants": _flag(
            "LookupStream calls of all-tenant tokens (node agents, routers)"
        ),
        "lookup_listen": _flag(
            "the lookup port, HOST:PORT; 'auto': the gRPC port + 1 on its host; 'off'"
        ),
        "lmdb_map_size_bytes": _flag("LMDB map of the index, e.g. 8GiB"),
        "metrics_listen": _flag("host:port of the Prometheus endpoint; empty: none"),
    },
)

NODE = Section(NodeConfig, "node")  # its settings declare themselves (node/agent.py)
