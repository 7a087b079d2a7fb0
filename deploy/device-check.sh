#!/usr/bin/env bash
# The CUDA path, checked in one run on a machine with a GPU, torch with CUDA and no network
# (a lent device; see deploy/README.md "A GPU check"): installs the dependencies from the
# wheels deploy/device-wheels.sh built beside it, puts the project's C extension (built for
# that Python) in place, runs tests/cuda and `kvstore bench gpu --device cuda --json`, and
# prints one JSON line: the tests' counts and the bench's object. Logs go to $OUT (or
# /tmp/device-check). Within 8 minutes.
#   deploy/device-check.sh [WHEELS]     (default .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${1:-.whl}
out=${OUT:-/tmp/device-check}
site=/tmp/kvstore-site
mkdir -p "$out"
started=$SECONDS

deps=$(ls "$wheels"/*.whl | grep -v '/kvstore-')
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" $deps >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 - "$wheels" <<'PY' || exit 1
import pathlib, sys, zipfile
[wheel] = pathlib.Path(sys.argv[1]).glob("kvstore-*.whl")
with zipfile.ZipFile(wheel) as archive:
    for name in archive.namelist():
        if name.startswith("kvstore/_copyhash") and name.endswith(".so"):
            pathlib.Path(name).write_bytes(archive.read(name))
PY
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1

# The agent's arena lives in /dev/shm: size the bench to what it holds (2 pages per chunk).
shm_mib=$(df --output=avail -BM /dev/shm | tail -1 | tr -dc 0-9)
chunks=$((shm_mib / 72))
chunks=$((chunks > 64 ? 64 : chunks))

timeout 300 python3 -m pytest -q -p no:cacheprovider tests/cuda --junitxml "$out/cuda.xml" \
  >"$out/cuda.log" 2>&1
tests_rc=$?
bench_rc=1
if [ "$chunks" -ge 4 ]; then
  timeout 180 python3 -m kvstore bench gpu --device cuda --chunks "$chunks" --json \
    >"$out/bench_gpu.json" 2>"$out/bench_gpu.log"
  bench_rc=$?
fi
python3 - "$out" "$tests_rc" "$bench_rc" "$chunks" "$shm_mib" "$((SECONDS - started))" <<'PY'
import json, pathlib, sys, xml.etree.ElementTree as tree
import torch
out, tests_rc, bench_rc, chunks, shm_mib, seconds = sys.argv[1:]
result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
          "torch": torch.__version__, "cuda": torch.version.cuda, "seconds": int(seconds),
          "tests_rc": int(tests_rc), "bench_rc": int(bench_rc), "bench_chunks": int(chunks),
          "dev_shm_mib": int(shm_mib)}
report = pathlib.Path(out, "cuda.xml")
if report.exists():
    suite = tree.parse(report).getroot().find("testsuite")
    result["tests"] = {key: int(suite.get(key)) for key in ("tests", "failures", "errors", "skipped")}
    for case in suite.iter("testcase"):
        for kind in ("failure", "error"):
            found = case.find(kind)
            if found is not None:
                message = f"{case.get('name')}: {found.get('message', '')[:300]}"
                result.setdefault("failed", []).append(message)
bench = pathlib.Path(out, "bench_gpu.json")
if bench.exists() and bench.read_text().strip():
    result["bench_gpu"] = json.loads(bench.read_text().strip().splitlines()[-1])
print(json.dumps(result))
PY
