"""How block bytes move between node agents: tcp sockets (default) or UCX (RDMA fabrics)."""

from kvstore.transfer.base import OpenBlock, TransferEngine, make_engine

__all__ = ["OpenBlock", "TransferEngine", "make_engine"]
