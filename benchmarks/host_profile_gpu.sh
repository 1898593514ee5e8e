#!/usr/bin/env bash
# Where the host's time goes in steady-state steps, per configuration, without torch.profiler's
# per-op cost: py-spy samples every rank (`py-spy record --subprocesses --nonblocking`, RATE per
# second) while `launch.train` runs STEPS steps with FSDP=NGPU; the raw stacks are gzipped to
# $OUT/spy_<n>.txt.gz (n = the configuration's place in CONFIGS) and summarised by
# `python -m benchmarks.spy_summary` (share of samples per region and function). py-spy comes
# from a wheel carried in .whl/ when it is not installed (pass carry=[".whl"]).
#   MODEL="--preset 1b --batch-size 4 --seq-len 2048" OUT=gpu_logs bash benchmarks/host_profile_gpu.sh
set -o pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
NGPU=${NGPU:-4}
STEPS=${STEPS:-20}
RATE=${RATE:-50}
MODEL=${MODEL:-"--preset 1b --batch-size 4 --seq-len 2048"}
CONFIGS=${CONFIGS:-"--baseline torchao-float8 --compile;--recipe fp8_current --quantized-init --compile"}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if ! command -v py-spy > /dev/null && ls .whl/py_spy-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .whl/py_spy-*.whl 2>&1 | tail -1; fi
if ! python3 -c "import torchao.float8" > /dev/null 2>&1 && ls .whl/torchao-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .whl/torchao-*.whl 2>&1 | tail -1; fi
port=29800
IFS=';' read -ra runs <<< "$CONFIGS"
files=()
for i in "${!runs[@]}"; do
  opts=${runs[$i]}; port=$((port + 1)); raw="$OUT/spy_$((i + 1)).txt"
  echo "== $opts"
  # shellcheck disable=SC2086
  timeout -k 20 ${CAP:-200} py-spy record -r "$RATE" --nonblocking --subprocesses -f raw -o "$raw" -- \
    torchrun --nproc-per-node "$NGPU" --master-port "$port" -m hybrid_dist.launch.train \
    $MODEL $opts --fsdp "$NGPU" --steps "$STEPS" --log-every 100 < /dev/null 2>&1 | grep -E "^summary|Error"
  gzip -f "$raw" && files+=("$raw.gz")
done
[ "${#files[@]}" -gt 0 ] && python3 -m benchmarks.spy_summary "${files[@]}" --top "${TOP:-20}"
