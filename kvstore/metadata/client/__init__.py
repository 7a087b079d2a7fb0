"""The metadata service's client side: the gRPC client, the lookup-port and LookupStream
clients it asks through, the event follower, the token file. Runs in node agents, workers'
connectors and CLI tools; imports only the shared records, wire and status modules."""

from kvstore.metadata.client.metadata_client import (
    EventStream,
    LookupResult,
    MetadataClient,
    SnapshotPage,
    lookup_result,
)

__all__ = ["EventStream", "LookupResult", "MetadataClient", "SnapshotPage", "lookup_result"]
