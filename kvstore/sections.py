"""The settings sections of the `kvstore` processes: the metadata service's ([metadata],
KVSTORE_METADATA_*) and the node agent's ([node], KVSTORE_NODE_*). Their dataclasses declare
every setting (type, default, help, flag, bounds) on its field, with kvstore.settings.setting.

Imported by the CLI (kvstore/cli.py) in the user's shell process.
"""

from __future__ import annotations

from kvstore.config import Section
from kvstore.metadata.server.server import MetadataConfig
from kvstore.node.agent import NodeConfig

METADATA = Section(MetadataConfig, "metadata")  # declared on its fields (server.py)
NODE = Section(NodeConfig, "node")  # declared on its fields (node/agent.py)
