"""`kvstore plan` on small synthetic traces: it agrees with `kvstore replay`, fp8 doubles the
blocks at equal bytes, Azure traces share nothing, bad input names its line or field."""

from __future__ import annotations

import json

import pytest

from kvstore.cli import main
from kvstore.errors import ConfigError
from kvstore.plan.model import PRESETS, load_model
from kvstore.replay import run_replay
from tests.plan.traces import write_mooncake

GIB = 1 << 30


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_hit_ratio_equals_kvstore_replay_at_the_same_capacity(tmp_path, capsys):
    trace = write_mooncake(tmp_path / "trace.jsonl")
    block_bytes = load_model("llama-3-8b").block_bytes("raw", 1, 512)
    capacity_blocks = 150
    dram = f"{capacity_blocks * block_bytes}"
    result = plan_json(capsys, trace, "--tiers", f"dram={dram};nvme=0", "--codecs", "raw")
    row = result["configs"][0]
    replay = run_replay(trace, "lru", capacity_blocks, progress=False)
    assert row["host_blocks"] == capacity_blocks
    assert 0.05 < replay["token_hit_ratio"] < 0.95  # the test exercises eviction and hits
    assert abs(row["token_hit_ratio"] - replay["token_hit_ratio"]) < 0.005
    assert abs(row["block_hit_ratio"] - replay["block_hit_ratio"]) < 0.005


def test_fp8_holds_twice_the_blocks_at_equal_bytes(tmp_path, capsys):
    trace = write_mooncake(tmp_path / "trace.jsonl")
    result = plan_json(capsys, trace, "--tiers", "dram=8GiB;nvme=0")
    raw, fp8 = result["configs"]
    assert fp8["host_blocks"] >= 2 * raw["host_blocks"] - 1
    assert fp8["token_hit_ratio"] > raw["token_hit_ratio"]


def test_a_disk_tier_adds_hits_below_the_host_tier(tmp_path, capsys):
    trace = write_mooncake(tmp_path / "trace.jsonl")
    rows = plan_json(capsys, trace, "--tiers", "dram=4GiB;nvme=0,64GiB", "--codecs", "raw")
    without, with_disk = rows["configs"]
    assert with_disk["disk_token_hit_ratio"] > 0 and without["disk_token_hit_ratio"] == 0
    assert with_disk["token_hit_ratio"] > without["token_hit_ratio"]
    # promotion from disk changes what the host holds, a little
    assert with_disk["host_token_hit_ratio"] == pytest.approx(
        without["host_token_hit_ratio"], abs=0.02
    )


def test_the_table_marks_the_cheapest_config_meeting_the_sla(tmp_path, capsys):
    trace = write_mooncake(tmp_path / "trace.jsonl")
    assert main(["plan", trace, "--tiers", "dram=0,16GiB;nvme=0", "--sla-ttft-s", "5"]) == 0
    out = capsys.readouterr().out
    assert "<- cheapest meeting the SLA" in out and "short<4k" in out
    result = plan_json(capsys, trace, "--tiers", "dram=0,16GiB;nvme=0", "--sla-ttft-s", "5")
    cheapest = [r for r in result["configs"] if r["cheapest"]]
    assert len(cheapest) == 1 and cheapest[0] == result["cheapest"]
    feasible = [r["usd_per_mtok"] for r in result["configs"] if r["meets_sla"]]
    assert cheapest[0]["usd_per_mtok"] == min(feasible)
    assert all(r["ttft_p90_s"] <= 5 + 1e-9 for r in result["configs"] if r["meets_sla"])


def test_plot_writes_three_pngs(tmp_path, capsys):
    from PIL import Image  # matplotlib's own dependency: there whenever --plot works

    trace = write_mooncake(tmp_path / "trace.jsonl", requests=150)
    result = plan_json(
        capsys, trace, "--tiers", "dram=0,8GiB;nvme=0,32GiB", "--plot", str(tmp_path / "plots")
    )
    assert len(result["plots"]) == 3
    for path in result["plots"]:
        with open(path, "rb") as png:
            header = png.read(8)
        assert header == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as image:  # a palette keeps committed figures small
            assert image.mode == "P" and image.width > 500


def test_azure_trace_shares_nothing_and_says_so(tmp_path, capsys):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,1396,109\n"
        "2023-11-16 18:15:51.1000000,374,9\n"
    )
    result = plan_json(capsys, str(path), "--tiers", "dram=64GiB;nvme=0")
    assert "no prefix information" in result["sharing"]
    assert all(row["token_hit_ratio"] == 0 for row in result["configs"])


def test_a_trace_line_without_hash_ids_names_the_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": 10}\n'
    )
    assert main(["plan", str(path)]) == 2
    error = capsys.readouterr().err
    assert f"{path}:2" in error and "hash_ids" in error


def test_a_config_without_num_key_value_heads_names_the_field(tmp_path, capsys):
    config = dict(PRESETS["llama-3-8b"])
    del config["num_key_value_heads"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    trace = write_mooncake(tmp_path / "trace.jsonl", requests=5)
    assert main(["plan", trace, "--model", str(path)]) == 2
    assert "num_key_value_heads" in capsys.readouterr().err


def test_a_trace_line_with_a_negative_length_names_the_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": -10, "hash_ids": [1]}\n'
    )
    assert main(["plan", str(path)]) == 2
    error = capsys.readouterr().err
    assert f"{path}:2" in error and "-10" in error


def test_a_config_with_negative_kv_heads_names_the_field(tmp_path, capsys):
    config = {**PRESETS["llama-3-8b"], "num_key_value_heads": -8}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    trace = write_mooncake(tmp_path / "trace.jsonl", requests=5)
    assert main(["plan", trace, "--model", str(path)]) == 2
    error = capsys.readouterr().err
    assert "num_key_value_heads" in error and "-8" in error


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tiers", "dram=-1GiB"], "dram"),
        (["--tiers", "nvme=0,-4TiB"], "nvme"),
        (["--tiers", "nodes=0"], "nodes"),
        (["--prices", "gpu_hour=-2"], "gpu_hour"),
        (["--bandwidths", "disk=0"], "disk"),
        (["--tp", "0"], "--tp"),
        (["--codecs", "zstd"], "zstd"),
    ],
)
def test_bad_sizes_and_settings_name_the_field(tmp_path, capsys, flags, named):
    trace = write_mooncake(tmp_path / "trace.jsonl", requests=5)
    assert main(["plan", trace, *flags]) == 2
    assert named in capsys.readouterr().err


def test_kv_bytes_per_token_of_the_presets():
    llama8b, llama70b = load_model("llama-3-8b"), load_model("llama-3-70b")
    assert llama8b.kv_bytes_per_token("raw", 1) == 32 * 8 * 128 * 2 * 2  # 128 KiB
    assert llama70b.kv_bytes_per_token("raw", 8) == 80 * 8 * 128 * 2 * 2  # 320 KiB over 8 ranks
    fp8 = llama8b.kv_bytes_per_token("fp8", 1)
    assert llama8b.kv_bytes_per_token("raw", 1) / 2 < fp8 < llama8b.kv_bytes_per_token("raw", 1)
    with pytest.raises(ConfigError, match="preset"):
        load_model("no-such-model")
