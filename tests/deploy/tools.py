"""Helpers of the deploy tests: the pinned tools (helm, kubectl, checkov; deploy/test-tools.sh
installs them) and chart renders parsed into Kubernetes objects."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "kvstore"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
BAD_VALUES = Path(__file__).parent / "bad-values"
NAMESPACE = "kvstore"


def tool(name: str) -> str:
    """The tool's path; a skip where it is missing, a failure where CI requires it."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not on PATH; run deploy/test-tools.sh in this venv"
        if os.environ.get("KVSTORE_REQUIRE_DEPLOY_TOOLS"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_tool(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([tool(args[0]), *args[1:]], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def helm_template(
    values: Path | None = None, *extra: str, release: str = "kv", check: bool = True
) -> subprocess.CompletedProcess:
    args = ["helm", "template", release, str(CHART), "--namespace", NAMESPACE]
    if values is not None:
        args += ["--values", str(values)]
    return run_tool(*args, *extra, check=check)


def objects(manifest: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


def render(values: Path | None = None, *extra: str) -> list[dict]:
    return objects(helm_template(values, *extra).stdout)


def pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
        return obj["spec"]["template"]["spec"]
    return None


def kvstore_containers(obj: dict) -> list[dict]:
    """The containers (sidecars included) that run the kvstore entrypoint."""
    spec = pod_spec(obj)
    if spec is None:
        return []
    every = spec.get("initContainers", []) + spec["containers"]
    return [
        c
        for c in every
        if "command" not in c and c.get("args", [""])[0] in ("serve", "node", "metadata")
    ]
