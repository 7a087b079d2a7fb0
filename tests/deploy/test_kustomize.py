"""The plain manifests of deploy/kustomize/base are the chart's default render (one source of
truth: deploy/render-manifests.sh), and `kubectl kustomize` builds them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.deploy.tools import DEPLOY, objects, run_tool, tool

BASE = DEPLOY / "kustomize" / "base"


def test_the_kustomize_base_equals_the_charts_render(tmp_path):
    rendered = tmp_path / "kvstore.yaml"
    env = {**os.environ, "PATH": f"{Path(tool('helm')).parent}:{os.environ['PATH']}"}
    subprocess.run([str(DEPLOY / "render-manifests.sh"), str(rendered)], check=True, env=env)
    assert rendered.read_text() == (BASE / "kvstore.yaml").read_text(), (
        "deploy/kustomize/base/kvstore.yaml is stale: run deploy/render-manifests.sh"
    )


def test_kubectl_kustomize_builds_every_object():
    built = objects(run_tool("kubectl", "kustomize", str(BASE)).stdout)
    committed = objects((BASE / "kvstore.yaml").read_text())
    key = lambda obj: (obj["kind"], obj["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, built)) == sorted(map(key, committed))
    assert {obj["kind"] for obj in built} >= {
        "StatefulSet",
        "DaemonSet",
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
    }
    assert all(obj["metadata"].get("namespace") == "kvstore" for obj in built)
