#!/usr/bin/env bash
# One device call on the GPU machine: build, GPU tests, then the benchmarks named in $@
# (default: "tests train io"). Everything lands under $OUT (logs, .md and .json results).
# Usage (device tool): bash benchmarks/gpu_session.sh tests train io
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/zo_out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # pytest/hypothesis wheels for machines without them (device README, Notes)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
[ -d .carry_bench/site ] && export PYTHONPATH=${PYTHONPATH:-}:$PWD/.carry_bench/site   # torchao, if carried
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -E 'Model name|^CPU\(s\)' | tee -a "$OUT/gpu.txt"
python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/zo_build.log 2>&1 \
  || { echo "pip install -e failed:"; tail -5 /tmp/zo_build.log; exit 1; }
python3 -c "import zero_offload.cpu_adam as c, torch; print('isa', c.isa(), 'torch', torch.__version__)"
[ $# -eq 0 ] && set -- tests train io
# before_tree: a checkout of an earlier commit at .before/ (carried, git-excluded) for side-by-side
# runs; built in place, used through PYTHONPATH (its own benchmarks/ scripts).
before_tree() {
  [ -f .before/setup.py ] || { echo "no .before/ checkout carried"; return 1; }
  [ -n "$(ls .before/zero_offload/_C*.so .before/src/zero_offload/_C*.so 2>/dev/null)" ] \
    || (cd .before && python3 setup.py build_ext --inplace > /tmp/zo_before_build.log 2>&1) \
    || { echo "build of .before failed"; tail -5 /tmp/zo_before_build.log; return 1; }
  if [ -d .before/src ]; then echo "$PWD/.before/src"; else echo "$PWD/.before"; fi
}
for what in "$@"; do
  case $what in
    trust)  # issue 10 on CUDA: the new GPU tests on this tree, then the tied-head test on the old engine
      { python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1
        ZO_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_engine_*.py 2>&1
        echo "== before (.before): tied head on CUDA"
        bt=$(before_tree) && PYTHONPATH=$bt:${PYTHONPATH:-} python3 -m pytest -q -p no:cacheprovider \
          tests/test_engine_external_params_gpu.py -k parity 2>&1 | tail -15; } \
        | tee "$OUT/tests_trust_cuda.log" | grep -E "passed|failed|error|^==" ;;
    compare*)  # before/after on the 1.31B benchmark, alternating per case (host drift hits both alike);
      # ZO_CMP_STEPS timed steps per run (default 7)
      bt=$(before_tree) || exit 1
      case $what in compare-engine) cases="engine-cpu engine-auto" ;; *) cases="offload-adamw offload-adamw-fwd" ;; esac
      for c in $cases; do for side in before after; do
        if [ $side = before ]; then script=.before/benchmarks/bench_train.py; pp=$bt:${PYTHONPATH:-}
        else script=benchmarks/bench_train.py; pp=${PYTHONPATH:-}; fi
        PYTHONPATH=$pp python3 $script --model 1.3b --batch 8 --steps ${ZO_CMP_STEPS:-7} --warmup 2 --cases $c --nvme-dir /tmp/zo \
          --json-out "$OUT/cmp_${c}_${side}.json" > "/tmp/cmp_${c}_${side}.log" 2>&1
        echo "$side: $(grep -E "^\[$c\]" /tmp/cmp_${c}_${side}.log | head -1)"
      done; done ;;
    tests)  # one log: GPU-marked tests, then the engine parity suite with CUDA as the device
      { python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1
        ZO_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_engine_*.py 2>&1; } \
        | tee "$OUT/tests_cuda.log" | grep -E "passed|failed|error" ;;
    train)  # traces of two steps per case go into one tarball (the device returns at most 8 files)
      python3 benchmarks/bench_train.py --model 1.3b --batch 8 --steps 7 --warmup 2 \
        --cases torch,engine-cpu,engine-auto,offload-adamw,offload-adamw-fwd,torchao --nvme-dir /tmp/zo \
        --trace-dir /tmp/zo_traces --md-out "$OUT/train_1.3b.md" --json-out "$OUT/train_1.3b.json" 2>&1 \
        | grep -E '^\[|\*\*'
      tar czf "$OUT/traces_1.3b.tar.gz" -C /tmp/zo_traces . ;;
    nvme)
      python3 benchmarks/bench_train.py --model 1.3b --batch 8 --steps 2 --warmup 1 --nvme-steps 2 \
        --cases torch,engine-nvme --nvme-dir /tmp/zo --disk-probe-mb 4096 \
        --md-out "$OUT/train_nvme.md" --json-out "$OUT/train_nvme.json" 2>&1 | grep -E '^\[|\*\*' ;;
    share)  # issue 13.1: the GPU share of the optimizer at GPU memory caps from torchao's footprint up,
      # beside torch and torchao. The engine's own working set (bf16 params + activations + grads
      # in flight) peaks near 19 GiB here (fresh process), hence the activation reserve.
      python3 benchmarks/bench_train.py --model 1.3b --batch 8 --steps 7 --warmup 2 \
        --cases torch,torchao,engine-gpu --nvme-dir /tmp/zo \
        --md-out "$OUT/train_share.md" --json-out "$OUT/train_share.json" 2>&1 | grep -E '^\[|\*\*|Error'
      for cap in ${ZO_SHARE_CAPS:-25.6 30 35}; do
        # ZO_SHARE_FLAGS: e.g. "--checkpointing" (with a smaller ZO_SHARE_RESERVE) frees activation
        # memory for the share under the same cap, at the cost of recomputing the forward
        python3 benchmarks/bench_train.py --model 1.3b --batch 8 --steps 7 --warmup 2 --cases engine-share \
          --gpu-cap $cap --activation-reserve ${ZO_SHARE_RESERVE:-17.5} --nvme-dir /tmp/zo ${ZO_SHARE_FLAGS:-} \
          --json-out "$OUT/train_share_cap$cap.json" 2>&1 | grep -E '^\[engine|Error' | cut -c1-900
      done ;;
    share-adamw)  # issue 13.1 for OffloadAdamW(state="auto", gpu_budget=G): GiB of optimizer state on
      # the GPU, the process capped at ZO_ADAMW_CAP GiB, beside the host-only OffloadAdamW
      python3 benchmarks/bench_train.py --model 1.3b --batch 8 --steps 7 --warmup 2 \
        --cases torch,torchao,offload-adamw-fwd --json-out "$OUT/train_share_adamw_base.json" 2>&1 \
        | grep -E '^\[|\*\*|Error'
      for g in ${ZO_ADAMW_SHARES:-4 8}; do
        python3 benchmarks/bench_train.py --model 1.3b --batch 8 --steps 7 --warmup 2 \
          --cases offload-adamw-share --gpu-budget $g --gpu-cap ${ZO_ADAMW_CAP:-35} \
          --json-out "$OUT/train_share_adamw_$g.json" 2>&1 | grep -E '^\[offload|Error' | cut -c1-900
      done ;;
    rss)  # host bytes per param from the start of a script: one case per process, model built on meta
      for c in engine-gpu engine-cpu; do
        /usr/bin/time -v python3 benchmarks/bench_train.py --model 1.3b --batch 8 --steps 3 --warmup 1 \
          --adam-sample 16777216 --cases $c > /tmp/rss_$c.log 2>&1
        echo "$c: $(grep -E "^\[$c\]" /tmp/rss_$c.log | cut -c1-160) | $(grep 'Maximum resident' /tmp/rss_$c.log)"
      done | tee "$OUT/rss.txt" ;;
    hostbytes)  # issue 24.2: host PSS per param from the start of the script, 1.31B, both grads layouts
      # (one process per layout), params on the GPU (the 12 B/param target) and on the host
      # (params on the host: the working copy against params made from the master, issue 24.2 ii)
      for p in gpu cpu; do
        layouts=persistent,window
        [ $p = cpu ] && layouts=persistent/copy,persistent/from-master,window/copy,window/from-master
        python3 benchmarks/bench_host_bytes.py --model 1.3b --batch 8 --params $p --layouts $layouts \
          --steps ${ZO_HB_STEPS:-5} --json-out "$OUT/host_bytes_1.3b.jsonl" 2>&1 | grep -E '^\[|Error'
      done ;;
    prefetch)  # issue 13.5: where depth matters (params on NVMe) and where it does not (all in pinned RAM).
      # At least 10 blocks per depth are measured (audit F12); NVMe steps take ~4 s, so its blocks are
      # of 1 step (10 rounds x 4 depths x (1 settle + 1 timed) x 4 s ~ 320 s, inside one device command)
      for cfg in "--params cpu --optimizer cpu" "--params nvme --optimizer nvme --nvme-dir /tmp/zo_pf --block 1"; do
        zero-offload bench prefetch --preset 350m $cfg --depths 0,1,2,4 --max-seconds ${ZO_PF_SECONDS:-100} \
          --out /tmp/zo_bench_pf 2>&1 | tail -14
      done | tee "$OUT/prefetch.txt"
      cp /tmp/zo_bench_pf/*.json "$OUT/" 2>/dev/null ;;
    big)  # issue 13.4: 7B at 32K tokens per step (activation checkpointing, 4 micro-batches of 8)
      python3 benchmarks/bench_train.py --model 7b --batch 8 --accum 4 --checkpointing --grad-sync final \
        --steps 2 --warmup 1 --cases engine-share --nvme-dir /tmp/zo \
        --md-out "$OUT/train_7b_32k.md" --json-out "$OUT/train_7b_32k.json" 2>&1 | grep -E '^\[|\*\*|Error' ;;
    largest13)  # issue 13.3: 12.8B from the meta device, optimizer state on the GPU share, RAM and NVMe
      python3 benchmarks/bench_train.py --model 13b --batch 8 --checkpointing --steps 2 --warmup 1 \
        --cases engine-largest --largest-params gpu --largest-cpu-budget ${ZO_CPU_BUDGET:-100GiB} \
        --activation-reserve ${ZO_ACT_RESERVE:-10} --nvme-dir /tmp/zo \
        --md-out "$OUT/train_largest.md" --json-out "$OUT/train_largest.json" 2>&1 | grep -E '^\[|\*\*|Error' ;;
    largest14-bf16)  # issue 13.3 past 13B with the opt-in INEXACT bf16 moments (10 B/param of state
      # beside the GPU share instead of 14): 44 layers x 5120, ~14B params
      python3 benchmarks/bench_train.py --layers 44 --hidden 5120 --heads 40 --vocab 32000 --seq 1024 \
        --batch 8 --checkpointing --steps 2 --warmup 1 --moments-dtype bf16 \
        --cases engine-largest --largest-params gpu --largest-cpu-budget ${ZO_CPU_BUDGET:-100GiB} \
        --activation-reserve ${ZO_ACT_RESERVE:-10} --nvme-dir /tmp/zo \
        --md-out "$OUT/train_largest14.md" --json-out "$OUT/train_largest14.json" 2>&1 | grep -E '^\[|\*\*|Error' ;;
    largest)
      python3 benchmarks/bench_train.py --layers 35 --hidden 4096 --heads 32 --vocab 32000 --seq 1024 --batch 4 \
        --steps 2 --warmup 1 --cases engine-largest --largest-params gpu --nvme-dir /tmp/zo \
        --md-out "$OUT/train_largest.md" --json-out "$OUT/train_largest.json" 2>&1 | grep -E '^\[|\*\*' ;;
    io)
      python3 benchmarks/bench_io.py --dir /tmp/zo_bench --size-gib 4 --repeats 3 --max-seconds 100 \
        --out "$OUT/io" 2>&1 | tail -36 ;;
    diag)  # what slows CPU-Adam inside a step: kernel alone vs beside PCIe / GIL load; traced steps
      python3 benchmarks/lab/diag_adam_contention.py --params 1.31e9 --chunk-mb 64 --json-out "$OUT/diag_adam.json" \
        2>&1 | tee "$OUT/diag_adam.log"
      for si in default 0.00025; do
        extra=(--cases torch,engine-cpu); [ $si != default ] && extra=(--switch-interval $si --cases torch,engine-cpu,offload-adamw,torchao)
        python3 benchmarks/bench_train.py --model 1.3b --batch 8 --steps 5 --warmup 2 \
          "${extra[@]}" --trace-dir "$OUT/trace_si$si" --md-out "$OUT/train_si$si.md" --json-out "$OUT/train_si$si.json" \
          2>&1 | tee "$OUT/train_si$si.log" | grep -E '^\[|engine-cpu\*\*' ; done ;;
    adam)  # DeepSpeedCPUAdam too when its wheels are carried in .whl/deepspeed/ (shared/wheels/README.md);
      # its cpu_adam op JIT-builds on first use (about a minute)
      if [ -d .whl/deepspeed ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ds_site .whl/deepspeed/*.whl \
          && export PYTHONPATH=${PYTHONPATH:-}:/tmp/ds_site DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=9.0 \
                    TORCH_EXTENSIONS_DIR=/tmp/ds_ext
      fi
      python3 benchmarks/bench_cpu_adam.py --threads 16 --sizes 100M,200M --repeats 9 --no-foreach \
        --md-out "$OUT/cpu_adam.md" --json-out "$OUT/cpu_adam.json" 2>&1 | tail -22 ;;
  esac
done
