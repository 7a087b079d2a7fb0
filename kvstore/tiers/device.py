"""Device tier: fixed-size pages in one torch tensor on an accelerator (`cpu` in tests).

Runs inside the inference worker that owns the device memory.
"""

from __future__ import annotations

import torch

from kvstore.errors import ConfigError
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import pages_for


class DeviceTier(ArenaTier):
    kind = "device"

    def __init__(self, capacity_bytes: int, page_size_bytes: int, device: str = "cpu") -> None:
        try:
            target = torch.device(device)
        except RuntimeError as exc:
            raise ConfigError(f"device tier: unknown device {device!r}") from exc
        if target.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device tier: CUDA is not available; use device='cpu'")
        num_pages = pages_for(capacity_bytes, page_size_bytes, self.kind)
        pages = torch.empty((num_pages, page_size_bytes), dtype=torch.uint8, device=target)
        super().__init__(pages)
