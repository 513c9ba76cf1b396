#!/usr/bin/env bash
# ONE device call of the fair training harness (issue 22): set up a bare GPU machine, then run
# one phase's plan through benchmarks/fair/run.py inside the call's time limit.
#
#   bash benchmarks/fair/device.sh setup-tests-n1   # kind nvidia-h100-x1 (or any): smoke + plan n1
#   bash benchmarks/fair/device.sh n2n4             # kind nvidia-h100-x4: plans n2 and n4
#   bash benchmarks/fair/device.sh n4               # any plan name of fairplan.PLANS, or items
#   bash benchmarks/fair/device.sh phases "7b:7b4 --batch 8 --checkpointing" "30b:big4 --checkpointing"
#
# `phases`: several run.py phases in ONE call, one argument each, `MODEL:PLAN [run.py args]`, run
# in the order given, each its own run.py (its own run id, model, batch, checkpointing, ...). The
# weights are `--init seeded:0` (FAIR_INIT overrides): torch.manual_seed(0) then GPT.init_weights,
# drawn in every case, no file (the only way at 14B-30B; not make_init.py's values, which come
# after the modules' own init drew from the same seed). Each phase gets the time left split evenly over the phases still
# to run (a `--deadline S` in its args overrides). Files under $OUT: rows_<i>_<MODEL>.jsonl per
# phase, one summary.md over every phase, logs.tar.gz (every phase's case logs), device.log,
# machine.txt, setup.log (+ tests.log with FAIR_TESTS): at most 8 files with two phases.
# PLAN is a plan name or items joined by ';' (no spaces inside one argument's PLAN), e.g.
# "7b:engine-auto@4;engine@4". The estimates: run.py --dry-run prints them (on a GPU machine:
# without one the GPU cases price at 0); fairplan [Note: estimates scale with the model],
# WORK_EXPONENT. Measured in session 14 with --checkpointing --batch 8: 7b engine-auto@4 54-58 s,
# fsdp2@4 108 s, ds-zero3@4 148-154 s; 14b engine-auto@1 with --nvme-dir on the x1 VM's disk:
# init 79 s + 65 s a step (more than one call for 3 + 5 steps); 30b engine-auto@4 (s13) ~375 s.
# When the driver's estimate would drop a case you need, give the phase `--deadline S` up to the
# call's limit. The big runs of issue 24 (kind nvidia-h100-x4;
# nvidia-h100-x1 for "big1"), e.g.:
#   bash benchmarks/fair/device.sh phases "30b:big4 --batch 8 --checkpointing"
#   bash benchmarks/fair/device.sh phases "7b:engine-auto@4 --batch 8 --checkpointing --deadline 170" \
#     "14b:big4-base --batch 8 --checkpointing"
#   bash benchmarks/fair/device.sh phases "14b:big1 --batch 8 --checkpointing --nvme-dir /tmp/zo_nvme"
#
# Carry `.whl` (a copy of ../shared/wheels: deepspeed/ and torchao/; see its README) for the
# DeepSpeed and torchao cases; without it those rows say "No module named ...". With its
# deepspeed/deb/ libaio is unpacked for DeepSpeed's async_io, built during the setup when a plan
# item has `nvme=1`: NVMe on one machine, both engines, the same placement (issue 22), e.g.
#   bash benchmarks/fair/device.sh phases "1.3b:engine:optimizer=nvme@1;ds-zero3:nvme=1@1 --batch 8 --nvme-dir /tmp/zo_nvme"
# Results under $OUT (at most 8 files come back): machine.txt, setup.log, rows.jsonl,
# summary.md, logs.tar.gz (every case's log and JSON), device.log.
# Knobs (env): FAIR_BUDGET total seconds for this script (default 540; the call is killed at
# 600), FAIR_SMOKE=0 skips the smoke of setup-tests-*, FAIR_ARGS extra run.py arguments
# (e.g. "--steps 30"), FAIR_SEED shuffle seed (default: the clock), ZO_FAIR_COMMIT the commit to
# record (default: a hash of the source tree; the device copy has no .git), FAIR_INIT the init
# file's path, FAIR_SKIP_INSTALL=1 keeps the zero_offload already installed (a warm machine whose
# csrc/ did not change), FAIR_TESTS a pytest command line run beside the setup (before any timed
# case; FAIR_TESTS_TIMEOUT, default 240 s: `-m gpu tests` took more than 200 s on the x4 kind, so
# give the GPU suite a call of its own: FAIR_TESTS="-m gpu tests" FAIR_TESTS_TIMEOUT=500 with a
# short plan). FAIR_BENCH_ADAM runs `bench adam` before the plan (see below). Carried .trees/NAME copies (tree.sh pack; the tree= knob of a plan item) are built
# in place during the setup (carry: [".whl", ".trees"]).
set -u -o pipefail
START=$SECONDS
BUDGET=${FAIR_BUDGET:-540}
OUT=${OUT:-/tmp/zo_fair_out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1
PHASE=${1:-setup-tests-n1}
PHASES=("${@:2}")  # `phases`: MODEL:PLAN [run.py args], one argument each
if [ "$PHASE" = phases ] && [ ${#PHASES[@]} -eq 0 ]; then
  echo "device.sh phases: give each phase as one argument, MODEL:PLAN [run.py args], e.g. \"30b:big4 --checkpointing\"" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ds_ext
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
say() { echo "[device.sh $((SECONDS - START))s] $*"; }

{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E 'Model name|^CPU\(s\)|NUMA node\(s\)'; free -g | head -2; df -h /dev/shm /tmp | tail -2
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# -- setup: the package, the carried wheels, DeepSpeed's CPU-Adam op, the init weights ---------
model=1.3b; seq=1024  # as run.py will be told (FAIR_ARGS may change them)
for a in ${FAIR_ARGS:-}; do
  [ "${prev:-}" = --model ] && model=$a; [ "${prev:-}" = --seq ] && seq=$a; prev=$a
done
need_kib=$(( 6 * 1024 * 1024 ))  # the 1.31B init file is 5.3 GB; /dev/shm of a container may be small
shm_kib=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
if [ -n "${FAIR_INIT:-}" ]; then INIT=$FAIR_INIT
elif [ "$PHASE" = phases ]; then INIT=seeded:0
elif [ "${shm_kib:-0}" -gt $(( 2 * need_kib )) ]; then INIT=/dev/shm/zo_fair_init_${model}_s${seq}.pt
else INIT=/tmp/zo_fair_init_${model}_s${seq}.pt; fi
wheels=$(ls .whl/deepspeed/*.whl .whl/torchao/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $wheels >> "$OUT/setup.log" 2>&1 \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || say "wheel install failed (see setup.log)"
  if ls .whl/deepspeed/deb/*.deb >/dev/null 2>&1; then  # libaio for DeepSpeed's async_io (ds-zero3:nvme=1)
    mkdir -p /tmp/aio && for d in .whl/deepspeed/deb/*.deb; do dpkg -x "$d" /tmp/aio; done
    L=/tmp/aio/usr/lib/x86_64-linux-gnu
    export CFLAGS="-I/tmp/aio/usr/include" LDFLAGS="-L$L" CPATH=/tmp/aio/usr/include LIBRARY_PATH=$L \
      LD_LIBRARY_PATH=$L${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
else
  say "no .whl/deepspeed or .whl/torchao carried: the ds-* and torchao rows will say so"
fi
# in the background while the package builds: DeepSpeed's JIT op (not inside a timed case) and
# the init weights
( if python3 -c "import deepspeed" >/dev/null 2>&1; then
    timeout 300 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
      > /tmp/ds_build.log 2>&1 && echo "cpu_adam op built" || { echo "cpu_adam op build FAILED:"; tail -5 /tmp/ds_build.log; }
    if [ -d /tmp/aio ] && [[ " $* " == *nvme=1* ]]; then  # only for a plan with DeepSpeed on NVMe
      timeout 300 python3 -c "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()" \
        > /tmp/ds_aio_build.log 2>&1 && echo "async_io op built" || { echo "async_io op build FAILED:"; tail -5 /tmp/ds_aio_build.log; }
    fi
  else echo "deepspeed not importable: ds-* rows will say so"; fi ) > /tmp/ds_build.status 2>&1 &
ds_pid=$!
( [ -f "$INIT" ] || [ "${INIT#seeded}" != "$INIT" ] || PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} timeout 300 python3 benchmarks/fair/make_init.py \
    --model "$model" --seq "$seq" --out "$INIT" ) > /tmp/make_init.log 2>&1 &
init_pid=$!
# carried .trees/NAME (tree.sh pack; the tree= knob): their extensions build beside the package
trees_pid=
if ls .trees/*/COMMIT >/dev/null 2>&1; then
  ( for t in .trees/*/; do n=$(basename "$t")
      if ls "$t"src/zero_offload/_C*.so >/dev/null 2>&1; then echo "tree $n already built"
      else timeout 300 bash benchmarks/fair/tree.sh build "$n" 2>&1; fi; done ) > /tmp/trees.log 2>&1 &
  trees_pid=$!
fi
if [ "${FAIR_SKIP_INSTALL:-0}" = 1 ]; then say "FAIR_SKIP_INSTALL=1: zero_offload as installed"
elif ! timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/zo_build.log 2>&1; then
  tail -20 /tmp/zo_build.log >> "$OUT/setup.log"
  say "pip install -e . failed: $(tail -1 /tmp/zo_build.log) (setup.log)"; exit 1
else say "zero_offload built"; fi
# FAIR_TESTS: a pytest command line run beside the rest of the setup (never beside a timed case),
# its log in $OUT/tests.log, waited for before the plan starts. It runs in a session of its own:
# `timeout` kills pytest only, and a multi-rank test's spawned ranks would outlive it into the
# timed cases (s18's first x4 call hit its timeout; its 4-GPU engine row is unexplained), so
# whatever is left of that session is killed after it.
if [ -n "${FAIR_TESTS:-}" ]; then
  ( setsid bash -c 'timeout "$1" python3 -m pytest -q -p no:cacheprovider $2 > "$3" 2>&1; echo "pytest exit $?" >> "$3"' \
      _ "${FAIR_TESTS_TIMEOUT:-240}" "${FAIR_TESTS}" "$OUT/tests.log" & spid=$!
    wait $spid
    left_over=$(pgrep -s "$spid" | wc -l)
    [ "$left_over" -gt 0 ] && { echo "killed $left_over process(es) the tests left behind:" >> "$OUT/tests.log"
      ps -o pid=,etime=,args= -s "$spid" | cut -c1-300 >> "$OUT/tests.log"; pkill -9 -s "$spid"; }
    exit 0 ) &
  tests_pid=$!
fi
if [ -n "$trees_pid" ]; then wait $trees_pid; cat /tmp/trees.log | tee -a "$OUT/setup.log"; fi
wait $init_pid; cat /tmp/make_init.log | tee -a "$OUT/setup.log"
wait $ds_pid; cat /tmp/ds_build.status | tee -a "$OUT/setup.log"
if [ -n "${tests_pid:-}" ]; then wait $tests_pid; say "tests: $(tail -2 "$OUT/tests.log" | tr '\n' ' ')"; fi
# Nothing but the plan on the GPUs from here: anything else computing there is named in the log.
busy=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null)
[ -n "$busy" ] && say "WARNING: processes on the GPUs before the timed cases: $(echo "$busy" | tr '\n' ';')"
say "setup done"

left() { echo $(( BUDGET - (SECONDS - START) )); }
# FAIR_BENCH_ADAM: arguments of `zero-offload bench adam` (issue 22's CPU-Adam row: ours, torch's
# and DeepSpeedCPUAdam, its op built above), run here, after the setup and before the plan, on every
# core of the node (OMP_NUM_THREADS = torch's = ours = nproc); $OUT/cpu_adam.md and .json (with the
# 6 files above, 8 come back: leave FAIR_TESTS out); its time comes out of the plan's deadline
if [ -n "${FAIR_BENCH_ADAM:-}" ]; then
  T=$(nproc)
  say "bench adam on $T threads: ${FAIR_BENCH_ADAM}"
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=$T timeout $(( $(left) > 120 ? $(left) - 60 : 60 )) python3 -m zero_offload.bench.cpu_adam \
    --threads "$T" ${FAIR_BENCH_ADAM} --json-out "$OUT/cpu_adam.json" --md-out "$OUT/cpu_adam.md" \
    > /tmp/cpu_adam.log 2>&1 || say "bench adam FAILED: $(tail -1 /tmp/cpu_adam.log)"
  grep -E '^(DeepSpeedCPUAdam|parity|\|)' /tmp/cpu_adam.log
fi
case $PHASE in
  setup-tests-*) plan=${PHASE#setup-tests-}
    if [ "${FAIR_SMOKE:-1}" != 0 ]; then  # the harness's GPU path on a tiny model, outside $OUT's rows
      say "smoke: tiny ddp + engine on the GPU"
      timeout 90 python3 benchmarks/fair/run.py --plan "ddp@1 engine@1" --model tiny --seq 128 --batch 4 \
        --warmup 1 --steps 3 --out /tmp/fair_smoke --init /tmp/fair_smoke_init.pt --deadline 80 \
        2>&1 | grep -E '^\[fair' || say "smoke FAILED (see /tmp/fair_smoke)"
    fi ;;
  *) plan=$PHASE ;;
esac
seed=${FAIR_SEED:-$(date +%s)}
if [ "$PHASE" = phases ]; then
  logs=/tmp/fair_logs_$(date +%s); rc=0; i=0; rows=()
  for spec in "${PHASES[@]}"; do
    i=$((i + 1)); read -r head rest <<< "$spec"; pmodel=${head%%:*}; pplan=${head#*:}
    if [ "$pmodel" = "$head" ] || [ -z "$pplan" ]; then say "phase $i: '$spec' is not MODEL:PLAN [args]; skipped"; rc=2; continue; fi
    share=$(( ($(left) - 15) / (${#PHASES[@]} - i + 1) ))
    rm -rf "/tmp/fair_phase$i"  # ours, from an earlier call on a warm machine: run.py appends rows
    say "phase $i: model $pmodel, plan $pplan, args '${rest}', deadline $share s, init $INIT"
    # the rows so far reach $OUT every 10 s: a call killed at its limit (a `--deadline` past what
    # is left, for a case the estimate would drop) still brings back the cases that finished
    ( while sleep 10; do [ -f "/tmp/fair_phase$i/rows.jsonl" ] && cp "/tmp/fair_phase$i/rows.jsonl" "$OUT/rows_${i}_$pmodel.jsonl"; done ) &
    copier=$!
    # shellcheck disable=SC2086
    python3 benchmarks/fair/run.py --plan "$pplan" --model "$pmodel" --out "/tmp/fair_phase$i" --init "$INIT" \
      --seed "$seed" --deadline "$share" --log-dir "$logs/phase${i}_$pmodel" --log-tar "$OUT/logs.tar.gz" ${FAIR_ARGS:-} $rest
    prc=$?; kill $copier 2>/dev/null; wait $copier 2>/dev/null; say "phase $i: run.py exit $prc"; [ $prc -ne 0 ] && rc=$prc
    if [ -f "/tmp/fair_phase$i/rows.jsonl" ]; then
      cp "/tmp/fair_phase$i/rows.jsonl" "$OUT/rows_${i}_$pmodel.jsonl"; rows+=("$OUT/rows_${i}_$pmodel.jsonl")
      cat "${rows[@]}" > /tmp/fair_phases_rows.jsonl
      python3 benchmarks/fair/summarize.py /tmp/fair_phases_rows.jsonl --out "$OUT/summary.md" > /dev/null
    fi
  done
  tar -czf "$OUT/logs.tar.gz.tmp" -C "$logs" . 2>/dev/null && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
  exit $rc
fi
say "plan $plan, shuffle seed $seed, deadline $(( $(left) - 15 )) s"
python3 benchmarks/fair/run.py --plan "$plan" --out "$OUT" --init "$INIT" --seed "$seed" \
  --deadline $(( $(left) - 15 )) --log-dir "/tmp/fair_logs_$(date +%s)" --log-tar "$OUT/logs.tar.gz" ${FAIR_ARGS:-}
rc=$?
say "run.py exit $rc"
exit $rc
