#!/usr/bin/env bash
# The recipe advisor end to end, and what the statistics cost:
# 1. a bf16 run of PRESET inspected every INSPECT steps, `launch.advise` on it (min SQNR MIN_SQNR);
# 2. bf16, fp8_current, mxfp8_fwd_nvfp4_bwd and the advised recipe, SEEDS each, STEPS steps as
#    single-GPU runs, spread over NGPU GPUs (each GPU runs its share one after another, so
#    tokens/s is that of an unshared GPU); `benchmarks.convergence_table` of the final losses;
# 3. with COST_MODEL set (e.g. "--preset 8b --layers 16 --batch-size 1 --seq-len 8192"): that
#    model on NGPU GPUs under FSDP, compiled, fp8_current + quantized init, COST_STEPS steps,
#    without and with --inspect-every COST_EVERY, in one call: the step-time ratio.
# Writes $OUT/advisor.log (every summary line as it comes), advised.{py,txt,png}, the plots and
# one archive of the JSONL files: few files, so a device call returns them all.
#   NGPU=2 OUT=gpu_logs bash benchmarks/run_advisor_gpu.sh
set -o pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
NGPU=${NGPU:-1}; PRESET=${PRESET:-125m}; STEPS=${STEPS:-300}; INSPECT=${INSPECT:-50}; SEEDS=${SEEDS:-"0 1 2"}
MIN_SQNR=${MIN_SQNR:-20}; COST_STEPS=${COST_STEPS:-30}; COST_EVERY=${COST_EVERY:-10}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
LOG=$OUT/advisor.log; T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
RUN="--preset $PRESET --steps $STEPS --batch-size ${BATCH:-8} --seq-len ${SEQ:-512} --lr ${LR:-1e-3} --log-every 100"
summary() { grep -E "^summary|Error" "$1" | tail -n 2 | cut -c1-260; }

if [ -n "${COST_MODEL:-}" ]; then
  log "== inspection cost: $COST_MODEL, FSDP $NGPU, compiled, fp8_current + qinit, $COST_STEPS steps"
  for every in 0 "$COST_EVERY"; do
    opts=""; [ "$every" != 0 ] && opts="--inspect-every $every --metrics $OUT/cost_inspect.jsonl"
    # shellcheck disable=SC2086
    timeout "${COST_TIMEOUT:-200}" torchrun --nproc-per-node "$NGPU" --master-port $((29400 + every)) \
      -m hybrid_dist.launch.train $COST_MODEL --fsdp "$NGPU" --compile --recipe fp8_current --quantized-init \
      --steps "$COST_STEPS" --log-every 100 $opts > "$OUT/cost_$every.log" 2>&1
    log "inspect-every $every: $(summary "$OUT/cost_$every.log")"
  done
fi

log "== bf16 $PRESET inspected every $INSPECT steps"
# shellcheck disable=SC2086
timeout "${RUN_TIMEOUT:-200}" torchrun --nproc-per-node 1 --master-port 29450 -m hybrid_dist.launch.train $RUN \
  --recipe bf16 --seed 0 --inspect-every "$INSPECT" --metrics "$OUT/inspected_bf16.jsonl" > "$OUT/inspected.log" 2>&1
log "$(summary "$OUT/inspected.log")"
python3 -m hybrid_dist.launch.advise "$OUT/inspected_bf16.jsonl" --min-sqnr "$MIN_SQNR" --out "$OUT/advised" \
  2>&1 | grep -E "choices|wrote" | tee -a "$LOG"

log "== 4 recipes x seeds ($SEEDS) on $NGPU GPUs"
jobs=()
for r in bf16 fp8_current mxfp8_fwd_nvfp4_bwd "$OUT/advised.py:recipe"; do
  for s in $SEEDS; do jobs+=("$r,$s"); done
done
for g in $(seq 0 $((NGPU - 1))); do
  (
    for j in $(seq "$g" "$NGPU" $((${#jobs[@]} - 1))); do
      r=${jobs[$j]%,*}; s=${jobs[$j]##*,}; tag=$(basename "${r%%:*}" .py)
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=$g timeout "${RUN_TIMEOUT:-200}" torchrun --nproc-per-node 1 --master-port $((29460 + j)) \
        -m hybrid_dist.launch.train $RUN --recipe "$r" --seed "$s" --metrics "$OUT/conv_${tag}_s$s.jsonl" \
        > "$OUT/conv_${tag}_s$s.log" 2>&1
      log "$tag seed $s: $(summary "$OUT/conv_${tag}_s$s.log")"
    done
  ) &
done
wait
python3 -m benchmarks.convergence_table "$OUT"/conv_*.jsonl 2>&1 | tee -a "$LOG"
python3 -m hybrid_dist.launch.plot "$OUT"/conv_*_s0.jsonl --out "$OUT/advisor_losses.png" > /dev/null 2>&1 \
  || log "(loss plot skipped)"
python3 -m hybrid_dist.launch.plot "$OUT/inspected_bf16.jsonl" --out "$OUT/inspected.png" > /dev/null 2>&1 \
  || log "(inspection plot skipped)"
(cd "$OUT" && tar czf advisor_runs.tgz --exclude=advisor.log ./*.jsonl ./*.log 2>/dev/null \
  && rm -f ./*.jsonl conv_*.log cost_*.log inspected.log)
log "== done"
