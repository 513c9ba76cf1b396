#!/usr/bin/env bash
# One device call on a multi-GPU kind (issue 12): build, the NCCL tests (2 GPUs), then
# benchmarks/bench_dp.py at each GPU count in $DP_NS (default "4 2 1", capped at the GPUs there)
# with the cases in $DP_CASES_<n> (default $DP_CASES, default "engine,engine-gpu"). Logs and one
# JSON per GPU count land in $OUT. DeepSpeed (case ds-zero3) comes from .whl/deepspeed (carried).
# Usage (device tool, kind nvidia-h100-x4): DP_CASES_4=engine,engine-gpu,ds-zero3,fsdp2-cpuoffload \
#   bash benchmarks/dp_session.sh [tests] [bench]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/zo_out}; mkdir -p "$OUT"
ngpu=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; echo "gpus $ngpu"
  lscpu | grep -E 'Model name|^CPU\(s\)'; free -g | head -2; } | tee "$OUT/dp_machine.txt"
python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/zo_build.log 2>&1 \
  || { echo "pip install -e failed:"; tail -5 /tmp/zo_build.log; exit 1; }
if [ -d .whl/deepspeed ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/deepspeed/*.whl > /dev/null 2>&1
  export PYTHONPATH=/tmp/site DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ds_ext
fi
[ $# -eq 0 ] && set -- tests bench
for what in "$@"; do
  case $what in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_engine_distributed_cuda.py 2>&1 \
        | tail -20 | tee "$OUT/dp_tests.log" ;;
    bench)
      for n in ${DP_NS:-4 2 1}; do
        [ "$n" -le "$ngpu" ] || continue
        var=DP_CASES_$n; cases=${!var:-${DP_CASES:-engine,engine-gpu}}
        timeout ${DP_TIMEOUT:-400} torchrun --standalone --nproc-per-node "$n" benchmarks/bench_dp.py \
          --cases "$cases" --steps ${DP_STEPS:-6} --warmup 2 --json-out "$OUT/dp_n$n.json" 2>&1 \
          | grep -vE "^\s*$|Warning|warn\(" | tail -30 | tee -a "$OUT/dp_bench.log"
      done ;;
    largest)  # the largest model of the node: 12.8B, params and optimizer offloaded (RAM, then NVMe),
      # at each GPU count in $DP_LARGEST_NS (default: all the GPUs only)
      for n in ${DP_LARGEST_NS:-$ngpu}; do
        [ "$n" -le "$ngpu" ] || continue
        timeout ${DP_TIMEOUT:-400} torchrun --standalone --nproc-per-node "$n" benchmarks/bench_dp.py \
          --model ${DP_LARGEST:-13b} --cases engine-largest --checkpointing --steps 2 --warmup 1 \
          --json-out "$OUT/dp_largest_n$n.json" 2>&1 | grep -vE "^\s*$|Warning|warn\(" | tail -30 \
          | tee -a "$OUT/dp_bench.log"
      done ;;
  esac
done
