#!/usr/bin/env bash
# ONE device call (issue 24 part 4, initialize at memory speed): the pin probe (bench_init.py
# pin-probe: every way of bringing a pinned buffer's pages in, twice), then `initialize` of a
# meta-built preset under "auto" with each way in WAYS (swap_io.POPULATE_THREADS; 0 = torch's
# fill, the engine before session 21), each case its own process (bench_init.py), then the GPU
# tests named by TESTS (never beside a timed case). Results under $OUT.
#
#   MODEL=14b WAYS="0 8" TESTS="-m gpu tests" bash benchmarks/lab/init_ways.sh
set -u -o pipefail
START=$SECONDS
OUT=${OUT:-/tmp/zo_init_out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1
say() { echo "[init_ways $((SECONDS - START))s] $*"; }
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E 'Model name|^CPU\(s\)'; free -g | head -2; uname -r
  cat /sys/kernel/mm/transparent_hugepage/enabled
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"; } 2>&1
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/zo_build.log 2>&1 \
    || { tail -20 /tmp/zo_build.log; say "build failed"; exit 1; }
  say "zero_offload built"
fi
timeout 200 python3 benchmarks/bench_init.py --cases pin-probe --probe-gib "${PROBE_GIB:-2}" \
  --json-out "$OUT/pin_probe.json" > "$OUT/pin_probe.log" 2>&1; say "pin probe exit $?"
grep -v '^\[pin-probe\] round' "$OUT/pin_probe.log" | tail -3
for w in ${WAYS:-0 8}; do
  timeout "${CASE_TIMEOUT:-200}" python3 benchmarks/bench_init.py --model "${MODEL:-14b}" --cases meta-auto \
    --activation-reserve "${RESERVE:-14}" --steps "${STEPS:-1}" --populate-threads "$w" \
    --json-out "$OUT/init_${MODEL:-14b}_populate$w.json" 2>&1 | grep -v "^\[meta-auto\] check" | tail -6
  say "initialize with populate threads $w: exit $?"
done
if [ -n "${TESTS:-}" ]; then
  timeout "${TESTS_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/tests.log"; tail -15 "$OUT/tests.log"
fi
say "done"
