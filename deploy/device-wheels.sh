#!/usr/bin/env bash
# Builds what deploy/device-check.sh carries to a GPU machine that has torch with CUDA but no
# network: the project's C extension built for the device's Python (a wheel of the project),
# and wheels of the dependencies its image lacks or has too old, at the versions installed in
# the environment that runs this script (the ones the tests passed with). Run it here, in the
# repository's root environment (e.g. .venv), then carry the folder (default .whl, ignored by
# git through .git/info/exclude).
#   deploy/device-wheels.sh [FOLDER]    env: DEVICE_PYTHON (default 3.12), PYTHON312 (a local
#                                       python of that version, to build the extension)
set -euo pipefail
cd "$(dirname "$0")/.."
folder=${1:-.whl}
version=${DEVICE_PYTHON:-3.12}
mkdir -p "$folder"
rm -f "$folder"/*.whl
grep -qxF "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >>.git/info/exclude

# What the device's image lacks (lmdb, redis, cryptography, cffi...) or holds at versions the
# generated stubs refuse (grpcio, protobuf): pinned to this environment's.
names=(grpcio grpcio-health-checking protobuf lmdb redis hiredis cryptography cffi pycparser xxhash
  typing_extensions)
pins=()
for name in "${names[@]}"; do
  pins+=("$name==$(python -c "import importlib.metadata as m; print(m.version('$name'))")")
done
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux_2_34_x86_64 manylinux_2_24_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
python -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
  --implementation cp "${platforms[@]}" -d "$folder" "${pins[@]}"

# The project itself, its extension compiled by a local Python of the device's version.
python312=${PYTHON312:-}
if [ -z "$python312" ]; then
  for candidate in "python$version" /root/.pyenv/versions/"$version"*/bin/python"$version"; do
    if "$candidate" -c pass 2>/dev/null; then
      python312=$candidate
      break
    fi
  done
fi
if [ -z "$python312" ]; then
  echo "no python$version here to build the extension with: set PYTHON312" >&2
  exit 1
fi
"$python312" -m pip wheel -q --no-deps -w "$folder" .
ls -l "$folder" >&2
du -sh "$folder" >&2
