#!/usr/bin/env bash
# Renders the plain manifests of deploy/kustomize/base/ from the Helm chart (default values,
# release and namespace "kvstore"): the chart is the one source of truth, and
# tests/deploy/test_kustomize.py checks the committed file equals this render.
# usage: deploy/render-manifests.sh [OUTPUT]   (needs helm on PATH)
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-kustomize/base/kvstore.yaml}
{
  echo "# Rendered from deploy/helm/kvstore by deploy/render-manifests.sh; edit the chart, not this."
  helm template kvstore helm/kvstore --namespace kvstore
} >"$out"
