"""Which engine blocks one stored block's positions fill (`BlockIndex`): built once per chunk
and step by the copy engine (engine.py) in the worker (the connectors' worker halves) and in
`kvstore bench gpu`, read by every layer's copies of that chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockIndex:
    """Which engine blocks a stored block's positions fill: `blocks` (on the device) holds the
    engine block of each position in [first, stop) of the stored block. `runs`, for host
    copies: every position of the stored block as (start, stop, first engine block) runs of
    consecutive engine blocks, the first engine block None where a run is not filled."""

    blocks: torch.Tensor
    first: int
    stop: int
    runs: tuple[tuple[int, int, int | None], ...] = ()

    def __len__(self) -> int:
        return self.stop - self.first


def block_runs(blocks: list[int], keep: range) -> tuple[tuple[int, int, int | None], ...]:
    """Positions 0..len(blocks) as (start, stop, first engine block) runs: consecutive engine
    blocks within `keep` make one run (one host copy), positions outside it runs of None."""
    runs = [(0, keep.start, None)] if keep.start else []
    for position in keep:
        start, stop, block = runs[-1] if runs else (0, 0, None)
        if block is not None and stop == position and blocks[position] == block + stop - start:
            runs[-1] = (start, position + 1, block)
        else:
            runs.append((position, position + 1, blocks[position]))
    if keep.stop < len(blocks):
        runs.append((keep.stop, len(blocks), None))
    return tuple(runs)
