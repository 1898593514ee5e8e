#!/usr/bin/env bash
# Where one training step's time goes, per configuration: `launch.train --profile-step`
# (rank 0: step wall time, kernel time, host time of the forward / backward / optimizer
# and FSDP2 regions, top kernels) on one host with NGPU GPUs, FSDP=NGPU.
# TRACE_DIR=DIR also writes each configuration's Chrome trace there (trace_<n>.json.gz, n = its
# place in CONFIGS; `python -m benchmarks.trace_summary DIR/trace_*.json.gz` reads them).
#   MODEL="--preset 8b --layers 16 --batch-size 1 --seq-len 8192" bash benchmarks/profile_step_gpu.sh
set -o pipefail
NGPU=${NGPU:-4}
STEPS=${STEPS:-4}
PSTEPS=${PSTEPS:-1}  # profiled steps, ending at STEPS: with PSTEPS > 1 the later ones show the steady state
MODEL=${MODEL:-"--preset 8b --layers 16 --batch-size 1 --seq-len 8192"}
CONFIGS=${CONFIGS:-"--recipe bf16 --compile;--baseline torchao-float8 --compile;--recipe fp8_current --quantized-init --compile"}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if ! python3 -c "import torchao.float8" > /dev/null 2>&1 && ls .whl/torchao-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .whl/torchao-*.whl 2>&1 | tail -1; fi
port=29700
IFS=';' read -ra runs <<< "$CONFIGS"
for i in "${!runs[@]}"; do
  opts=${runs[$i]}
  port=$((port + 1))
  echo "== $opts"
  trace=()
  [ -n "${TRACE_DIR:-}" ] && mkdir -p "$TRACE_DIR" && trace=(--profile-trace "$TRACE_DIR/trace_$((i + 1)).json.gz")
  # shellcheck disable=SC2086
  timeout -k 20 ${CAP:-150} torchrun --nproc-per-node "$NGPU" --master-port "$port" -m hybrid_dist.launch.train \
    $MODEL $opts --fsdp "$NGPU" --steps "$STEPS" --profile-step $((STEPS - PSTEPS + 1)) --profile-steps "$PSTEPS" "${trace[@]}" --log-every 100 < /dev/null 2>&1 \
    | grep -E "^profile|^  host|^  gpu|^  cpu|^summary|Error" | grep -v "^W1"
done
