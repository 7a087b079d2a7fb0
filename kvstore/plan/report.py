"""The plan as a person reads it: a header of assumptions and one table row per configuration,
the cheapest one meeting the SLA marked. Runs in the `kvstore plan` process.
"""

from __future__ import annotations

COLUMNS = (
    ("codec", "codec", "{}"),
    ("DRAM GiB", "dram_gib", "{:.0f}"),
    ("NVMe GiB", "nvme_gib", "{:.0f}"),
    ("nodes", "nodes", "{}"),
    ("hit%", "token_hit_ratio", "{:.1%}"),
    ("host%", "host_token_hit_ratio", "{:.1%}"),
    ("disk%", "disk_token_hit_ratio", "{:.1%}"),
    ("saved%", "prefill_tokens_saved_ratio", "{:.1%}"),
    ("idle p50", "ttft_idle_p50_s", "{:.3f}"),
    ("idle p90", "ttft_idle_p90_s", "{:.3f}"),
    ("p50@SLA", "ttft_p50_s", "{:.3f}"),
    ("GPU-s/req", "gpu_s_per_request", "{:.3f}"),
    ("req/s@SLA", "throughput_at_sla_req_s", "{:.2f}"),
    ("$/Mtok", "usd_per_mtok", "{:.4f}"),
)


def format_plan(result: dict) -> str:
    lines = [
        f"trace   {result['trace']}: {result['requests']} requests, "
        f"{result['prompt_tokens']} prompt tokens over {result['trace_duration_s']:.0f} s",
        f"sharing {result['sharing']}",
        f"model   {result['model']}, TP {result['tp_size']}, {result['gpus_per_node']} GPUs/node; "
        + ", ".join(
            f"{c} {b / 1024:.1f} KiB/token" for c, b in result["kv_bytes_per_token"].items()
        ),
        f"SLA     {result['sla']} (per model instance, FIFO prefill queue); prices "
        + ", ".join(f"{k}=${v}" for k, v in result["prices"].items()),
        "",
        _table(result["configs"]),
        "hit% = prompt tokens found in DRAM/NVMe; saved% = those worth loading (the rest is "
        "faster to compute); idle p50/p90 = TTFT (s) on an idle instance; p50@SLA = TTFT p50 at "
        "req/s@SLA, the most one instance serves within the SLA; $/Mtok per million prompt tokens",
        "",
        _ttft_classes(result["cheapest"]),
    ]
    return "\n".join(lines)


def _table(rows: list[dict]) -> str:
    cells = [[title for title, _, _ in COLUMNS] + [""]]
    for row in rows:
        cells.append([_cell(row[name], fmt) for _, name, fmt in COLUMNS] + [_mark(row)])
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _mark(row: dict) -> str:
    if row["cheapest"]:
        return "<- cheapest meeting the SLA"
    return "" if row["meets_sla"] else "(misses SLA)"


def _ttft_classes(cheapest: dict | None) -> str:
    if cheapest is None:
        return "no configuration meets the SLA"
    parts = [
        f"{name} ({figures['requests']} req): p50 {figures['ttft_p50_s']:.3f} s, "
        f"p90 {figures['ttft_p90_s']:.3f} s"
        for name, figures in cheapest["ttft_by_class"].items()
    ]
    return "cheapest config, TTFT by request class at its SLA load: " + "; ".join(parts)
