"""`kvstore plan --plot DIR`: PNGs a person reads without the JSON: hit ratio vs capacity per
tier, $/Mtok vs DRAM and NVMe size, TTFT CDF. Runs in the `kvstore plan` process (matplotlib,
headless Agg backend); each PNG reduced to a 256-colour palette (Pillow, which matplotlib
needs), a third of the bytes of full colour for line plots.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from kvstore.errors import ConfigError

CHEAPEST = "cheapest meeting the SLA"
PALETTE_COLOURS = 256


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvstore[plan]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def write_plots(result: dict, directory: Path) -> list[str]:
    """Write the three figures into `directory` (created); return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    pyplot = _pyplot()
    title = f"{Path(result['trace']).name}, {result['model']}, TP {result['tp_size']}"
    paths = [
        _hit_ratio(pyplot, result, directory / "hit_ratio_vs_capacity.png", title),
        _cost(pyplot, result, directory / "usd_per_mtok_vs_capacity.png", title),
        _ttft_cdf(pyplot, result, directory / "ttft_cdf.png", title),
    ]
    return [str(path) for path in paths]


def _grid(rows: list[dict], codec: str, nodes: int) -> tuple[list[float], list[float], dict]:
    """DRAM sizes, NVMe sizes, and rows by (dram, nvme) for one codec and node count."""
    chosen = [r for r in rows if r["codec"] == codec and r["nodes"] == nodes]
    drams = sorted({r["dram_gib"] for r in chosen})
    nvmes = sorted({r["nvme_gib"] for r in chosen})
    return drams, nvmes, {(r["dram_gib"], r["nvme_gib"]): r for r in chosen}


def _panels(pyplot, result: dict):
    codecs = list(result["kv_bytes_per_token"])
    figure, axes = pyplot.subplots(1, len(codecs), figsize=(6.5 * len(codecs), 4.8), sharey=True)
    return figure, np.atleast_1d(axes), codecs, min(r["nodes"] for r in result["configs"])


def _dram_axis(axis, drams: list[float]) -> None:
    axis.set_xticks(range(len(drams)), [f"{d:.0f}" for d in drams])
    axis.set_xlabel("host DRAM per node (GiB)")
    axis.grid(alpha=0.3)


def _per_codec(pyplot, result: dict, draw) -> tuple:
    """One panel per codec; `draw(axis, color, nvme, drams, rows)` draws one NVMe size's line."""
    figure, axes, codecs, nodes = _panels(pyplot, result)
    for axis, codec in zip(axes, codecs, strict=True):
        drams, nvmes, rows = _grid(result["configs"], codec, nodes)
        for color, nvme in enumerate(nvmes):
            draw(axis, f"C{color}", nvme, drams, rows)
        _dram_axis(axis, drams)
        per_token = result["kv_bytes_per_token"][codec] / 1024
        axis.set_title(f"{codec} KV ({per_token:.0f} KiB/token)")
        handles, labels = axis.get_legend_handles_labels()
        order = sorted(range(len(labels)), key=lambda i: labels[i] == CHEAPEST)  # marker last
        axis.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8)
    return figure, axes, nodes


def _hit_ratio(pyplot, result: dict, path: Path, title: str) -> Path:
    def draw(axis, color, nvme, drams, rows):
        total = [100 * rows[(d, nvme)]["token_hit_ratio"] for d in drams]
        host = [100 * rows[(d, nvme)]["host_token_hit_ratio"] for d in drams]
        axis.plot(total, "o-", color=color, label=f"NVMe {nvme:.0f} GiB: DRAM + NVMe")
        axis.plot(host, "x:", color=color, label=f"NVMe {nvme:.0f} GiB: from DRAM")

    figure, axes, nodes = _per_codec(pyplot, result, draw)
    axes[0].set_ylabel("prompt tokens served from the cache (%)")
    figure.suptitle(f"Token hit ratio per tier vs capacity ({nodes} node(s)) — {title}")
    return _save(pyplot, figure, path)


def _cost(pyplot, result: dict, path: Path, title: str) -> Path:
    def draw(axis, color, nvme, drams, rows):
        values = [rows[(d, nvme)]["usd_per_mtok"] for d in drams]
        values = [np.nan if value is None else value for value in values]
        axis.plot(values, "o-", color=color, label=f"NVMe {nvme:.0f} GiB")
        for x, dram in enumerate(drams):
            if rows[(dram, nvme)]["cheapest"]:
                axis.plot(x, values[x], "*", color="red", markersize=18, label=CHEAPEST, zorder=3)

    figure, axes, _ = _per_codec(pyplot, result, draw)
    axes[0].set_ylabel("$ per million prompt tokens at the SLA load")
    figure.suptitle(f"$/Mtok vs DRAM and NVMe size, {result['sla']} — {title}")
    return _save(pyplot, figure, path)


def _ttft_cdf(pyplot, result: dict, path: Path, title: str) -> Path:
    rows = result["configs"]
    baseline = min(rows, key=lambda r: (r["dram_gib"] + r["nvme_gib"], r["codec"] != "raw"))
    largest = max(rows, key=lambda r: (r["prefill_tokens_saved_ratio"], r["token_hit_ratio"]))
    picked = {"no cache" if baseline["token_hit_ratio"] == 0 else "smallest": baseline}
    cheapest = next((r for r in rows if r["cheapest"]), None)
    if cheapest is not None:
        picked[CHEAPEST] = cheapest
    if all(largest is not row for row in picked.values()):
        picked["most prefill saved"] = largest
    figure, axis = pyplot.subplots(figsize=(8, 5))
    for name, row in picked.items():
        values = np.sort(row["_service_s"])
        label = (
            f"{name}: {row['codec']}, DRAM {row['dram_gib']:.0f} GiB, "
            f"NVMe {row['nvme_gib']:.0f} GiB, hit {row['token_hit_ratio']:.0%}"
        )
        axis.plot(values, np.arange(1, len(values) + 1) / len(values), label=label)
    axis.axvline(result["sla_ttft_s"], color="grey", linestyle="--", label="SLA TTFT")
    axis.set_xscale("log")
    axis.set_xlabel("TTFT on an idle instance: load + prefill, no queueing (s)")
    axis.set_ylabel("fraction of requests")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    axis.set_title(f"TTFT CDF — {title}", fontsize=10)
    return _save(pyplot, figure, path)


def _save(pyplot, figure, path: Path) -> Path:
    from PIL import Image

    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    pyplot.close(figure)
    image = Image.open(buffer).convert("RGB")
    image.quantize(colors=PALETTE_COLOURS).save(path, format="PNG", optimize=True)
    return path
