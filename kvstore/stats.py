"""Cluster stats for people and machines: the `kvstore stats` table and its JSON form.

Runs in the CLI process; reads one StatsResponse from the metadata service.
"""

from __future__ import annotations

from google.protobuf.json_format import MessageToDict

from kvstore.v1 import metadata_pb2 as pb


def stats_dict(response: pb.StatsResponse) -> dict:
    return MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def format_stats(stats: dict) -> str:
    tiers = ("device", "host", "disk")
    lines = [
        f"backend {stats['backend']} · {len(stats['nodes'])} live nodes · "
        f"{stats['blocks']} blocks · last event #{stats['last_event_seq']}",
        "",
        f"{'node':<24} {'tcp':<22} {'lease left':>10} " + " ".join(f"{t:>8}" for t in tiers),
    ]
    for entry in stats["nodes"]:
        node, per_tier = entry["node"], entry.get("blocks_per_tier", {})
        lease_s = int(entry["lease_expires_in_ms"]) / 1000
        lines.append(
            f"{node['node_id']:<24} {node.get('tcp_address', ''):<22} {lease_s:>9.1f}s "
            + " ".join(f"{int(per_tier.get(t, 0)):>8}" for t in tiers)
        )
    totals = stats.get("blocks_per_tier", {})
    lines.append(
        f"{'total':<24} {'':<22} {'':>10} " + " ".join(f"{int(totals.get(t, 0)):>8}" for t in tiers)
    )
    return "\n".join(lines)
