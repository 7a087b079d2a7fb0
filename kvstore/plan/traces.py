"""Trace readers for the planner: Mooncake JSONL (prefix-chained block ids) and the Azure 2023
LLM inference CSVs (arrival times and lengths only). Runs in the `kvstore plan` process.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.replay import TRACE_BLOCK_TOKENS, TraceRequest, load_trace

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class PlanTrace:
    """Requests in arrival order; `has_prefix_info` is False when the trace cannot say which
    prompts share a prefix (then every hit ratio is zero by construction, not measured)."""

    path: str
    requests: list[TraceRequest]
    has_prefix_info: bool

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000.0

    @property
    def note(self) -> str:
        if self.has_prefix_info:
            return "prefix sharing from the trace's chained 512-token block ids"
        return (
            "this trace has lengths only, no prefix information: its sharing is taken as zero, "
            "so every hit ratio is 0 by construction (not measured)"
        )


def read_trace(path: str | Path, limit: int | None = None) -> PlanTrace:
    """Read a Mooncake `.jsonl` or an Azure `.csv` trace; ConfigError names the bad line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace {path}: no such file")
    if path.suffix == ".csv":
        requests, sharing = _read_azure(path), False
    else:
        requests, sharing = load_trace(path), True
    if limit is not None:
        requests = requests[:limit]
    if not requests:
        raise ConfigError(f"trace {path}: no requests")
    return PlanTrace(str(path), requests, sharing)


def _read_azure(path: Path) -> list[TraceRequest]:
    """Azure 2023 rows `TIMESTAMP,ContextTokens,GeneratedTokens`. Every request gets block ids
    of its own (negative, never shared), so nothing can hit."""
    with open(path, encoding="utf-8", newline="") as rows:
        reader = csv.DictReader(rows)
        missing = [name for name in AZURE_COLUMNS if name not in (reader.fieldnames or ())]
        if missing:
            raise ConfigError(f"{path}:1: missing column(s) {missing} of an Azure 2023 trace")
        parsed = [_azure_row(row, f"{path}:{number}") for number, row in enumerate(reader, 2)]
    start = min((stamp for stamp, _ in parsed), default=0.0)
    requests, next_id = [], -1
    for stamp, tokens in sorted(parsed, key=lambda item: item[0]):
        blocks = math.ceil(tokens / TRACE_BLOCK_TOKENS)
        ids = tuple(range(next_id, next_id - blocks, -1))
        next_id -= blocks
        requests.append(TraceRequest((stamp - start) * 1000.0, tokens, ids))
    return requests


def _azure_row(row: dict, where: str) -> tuple[float, int]:
    try:
        stamp = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
        tokens = int(row["ContextTokens"])
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: not an Azure 2023 trace row ({exc})") from None
    if tokens <= 0:
        raise ConfigError(f"{where}: ContextTokens must be positive, got {tokens}")
    return stamp, tokens
