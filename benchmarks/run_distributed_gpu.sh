#!/usr/bin/env bash
# One full run on a multi-GPU host (2-4 GPUs, NCCL): the gpu-marked distributed and MoE
# tests, the TP and expert-parallel benchmarks, then the launcher with tensor and expert
# parallelism against bf16 in the same call (8b L16 at TP=2 x FSDP=NGPU/2, without and with
# --sequence-parallel; the 1b and 8b L4
# MoE presets at EP=NGPU), each run capped. Logs go to $OUT (or ./gpu_logs); the launcher
# rows end in one table ($OUT/dist_throughput.md, python -m benchmarks.throughput).
# STAGES (default "tests tp moe_ep launch tp_compile": the TP benchmark compiled, last, in
# what is left of the budget; also "fsdp2": the 8-block stack at 1x4096 with its host-time
# profile) picks the stages; ONLY (a regex) the launcher runs by name; BUDGET_S (default 540) stops
# starting launcher runs after that many seconds of the whole script. TP_M, MOE1, MOE8
# override the models (CPU check: NGPU=2 STAGES=launch TP_M="--preset tiny --batch-size 2
# --seq-len 64" MOE1="--preset tiny --moe-experts 4 --moe-top-k 2 --batch-size 2 --seq-len 64"
# MOE8="$MOE1" bash benchmarks/run_distributed_gpu.sh).
#   OUT=gpu_logs bash benchmarks/run_distributed_gpu.sh
set -o pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
STAGES=${STAGES:-"tests tp moe_ep launch tp_compile"}
BUDGET_S=${BUDGET_S:-540}
has() { [[ " $STAGES " == *" $1 "* ]]; }
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"
if has tests; then
  N=""; python3 -c "import xdist" 2> /dev/null && N="-n 4"
  # shellcheck disable=SC2086
  timeout 230 python3 -m pytest -q -m gpu $N -p no:cacheprovider tests_distributed tests/moe 2>&1 | tail -15 \
    | tee "$OUT/dist_tests.log"
fi
has fsdp2 && timeout 170 torchrun --nproc_per_node "$NGPU" -m benchmarks.fsdp2 --seq 4096 --profile 2>&1 | grep -v "^W1" \
  | tee "$OUT/fsdp2_bench.log"
has tp && timeout 120 torchrun --nproc_per_node "$NGPU" -m benchmarks.tp 2>&1 | grep -v "^W1" | tee "$OUT/tp_bench.log"
has moe_ep && timeout 150 torchrun --nproc_per_node "$NGPU" -m benchmarks.moe_ep --recipes bf16,fp8_current,mxfp8 \
  --steps 6 --warmup 2 2>&1 | grep -v "^W1" | tee "$OUT/moe_ep_bench.log"
if has launch; then
  TP_M=${TP_M:-"--preset 8b --layers 16 --batch-size 1 --seq-len 8192 --compile"}" --tp 2 --fsdp $((NGPU / 2))"
  MOE1=${MOE1:-"--preset 1b --moe-experts 8 --moe-top-k 2 --batch-size 2 --seq-len 2048"}" --ep $NGPU --fsdp $NGPU"
  MOE8=${MOE8:-"--preset 8b --layers 4 --moe-experts 8 --moe-top-k 2 --batch-size 1 --seq-len 4096"}" --ep $NGPU --fsdp $NGPU"
  port=29900
  # name | launcher options (bf16 first in each pair: the ratio's baseline)
  while IFS='|' read -r name opts; do
    [ -z "$name" ] && continue
    [[ -n "$ONLY" && ! "$name" =~ $ONLY ]] && continue
    left=$((BUDGET_S - SECONDS))
    if [ "$left" -lt 60 ]; then echo "-- $name skipped (budget)"; continue; fi
    port=$((port + 1)); cap=$((left < 150 ? left : 150)); t0=$SECONDS
    # shellcheck disable=SC2086
    timeout -k 10 "$cap" torchrun --nproc-per-node "$NGPU" --master-port "$port" \
      -m hybrid_dist.launch.train $opts --steps 8 --log-every 100 --metrics "$OUT/dist_thr_$name.jsonl" \
      > "$OUT/dist_thr_$name.log" 2>&1
    rc=$?
    if grep -q '^summary' "$OUT/dist_thr_$name.log"; then
      echo "-- $name: $(grep -E '^summary' "$OUT/dist_thr_$name.log" | tail -1 | cut -c1-220)"
    else  # a crash names its error; a run stopped at the cap shows how far it got
      echo "-- $name: no summary (rc=$rc after $((SECONDS - t0)) s, cap ${cap} s; 124 = stopped at the cap):"
      { grep -E 'Error|Exception|error:' "$OUT/dist_thr_$name.log" | grep -v -E 'ChildFailedError|SignalException|^W[0-9]'
        grep -E '^step ' "$OUT/dist_thr_$name.log" | tail -n 1; } | head -n 4 | cut -c1-200 | sed 's/^/     /'
    fi
  done <<PLAN
tp2_8b_bf16|$TP_M --recipe bf16
tp2_8b_fp8_current|$TP_M --recipe fp8_current
tp2_8b_bf16_sp|$TP_M --recipe bf16 --sequence-parallel
tp2_8b_fp8_current_sp|$TP_M --recipe fp8_current --sequence-parallel
ep_1b_moe8_bf16|$MOE1 --recipe bf16
ep_1b_moe8_fp8_current|$MOE1 --recipe fp8_current
ep_8b_L4_moe8_bf16|$MOE8 --recipe bf16
ep_8b_L4_moe8_fp8_current|$MOE8 --recipe fp8_current
ep_1b_moe8_bf16_compile|$MOE1 --recipe bf16 --compile
ep_1b_moe8_fp8_current_compile|$MOE1 --recipe fp8_current --compile
ep_8b_L4_moe8_bf16_compile|$MOE8 --recipe bf16 --compile
ep_8b_L4_moe8_fp8_current_compile|$MOE8 --recipe fp8_current --compile
PLAN
  ls "$OUT"/dist_thr_*.jsonl > /dev/null 2>&1 && python3 -m benchmarks.throughput "$OUT"/dist_thr_*.jsonl \
    | tee "$OUT/dist_throughput.md"
fi
if has tp_compile && [ $((BUDGET_S + 30 - SECONDS)) -gt 60 ]; then
  timeout $((BUDGET_S + 30 - SECONDS)) torchrun --nproc_per_node "$NGPU" -m benchmarks.tp --compile \
    --recipes bf16,fp8_current,fp8_delayed,mxfp8 2>&1 | grep -v "^W1" | tee "$OUT/tp_compile_bench.log"
fi
echo "total wall: ${SECONDS} s"
