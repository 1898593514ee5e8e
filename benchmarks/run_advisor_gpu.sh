#!/usr/bin/env bash
# The recipe advisor end to end, and what the statistics cost:
# 1. a bf16 run of PRESET inspected every INSPECT steps, `launch.advise` on it (min SQNR MIN_SQNR);
# 2. bf16, fp8_current, mxfp8_fwd_nvfp4_bwd and the advised recipe, SEEDS each, STEPS steps as
#    single-GPU runs, spread over NGPU GPUs (each GPU runs its share one after another, so
#    tokens/s is that of an unshared GPU); `benchmarks.convergence_table` of the final losses;
# 3. with COST_MODEL set (e.g. "--preset 8b --layers 16 --batch-size 1 --seq-len 8192"): that
#    model on NGPU GPUs under FSDP, compiled, fp8_current + quantized init, COST_STEPS steps,
#    without and with --inspect-every COST_EVERY, in one call: `benchmarks.inspect_cost` of the two
#    (the extra time of a logging step, and the step-time cost at COST_EVERY and at 100).
# PHASES (default "cost inspect train") picks steps; without "inspect", ADVISED names the advised
# recipe to train (default $OUT/advised.py). RECIPES overrides the trained recipes.
# Writes $OUT/advisor.log (every summary line as it comes), advised.{py,txt,png}, the plots and
# runs.tar (each run's JSONL and log, appended as it finishes): few files, so a device call
# returns them all, also when it is stopped early.
#   NGPU=2 OUT=gpu_logs bash benchmarks/run_advisor_gpu.sh
#   PHASES=train ADVISED=advised.py RECIPES="advised" SEEDS="0" bash benchmarks/run_advisor_gpu.sh
set -o pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
NGPU=${NGPU:-1}; PRESET=${PRESET:-125m}; STEPS=${STEPS:-300}; INSPECT=${INSPECT:-50}; SEEDS=${SEEDS:-"0 1 2"}
MIN_SQNR=${MIN_SQNR:-20}; COST_STEPS=${COST_STEPS:-30}; COST_EVERY=${COST_EVERY:-10}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
LOG=$OUT/advisor.log; T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
RUN="--preset $PRESET --steps $STEPS --batch-size ${BATCH:-8} --seq-len ${SEQ:-512} --lr ${LR:-1e-3} --log-every 100"
PHASES=${PHASES:-"cost inspect train"}; ADVISED=${ADVISED:-$OUT/advised.py}
RECIPES=${RECIPES:-"bf16 fp8_current mxfp8_fwd_nvfp4_bwd advised"}
summary() { grep -E "^summary|Error" "$1" | tail -n 2 | cut -c1-260; }
WORK=$(mktemp -d)  # copies of the JSONL files for the table and plots (outside $OUT)
keep() {  # archive files of $OUT into runs.tar as runs finish (one writer at a time)
  (cd "$OUT" && cp "$@" "$WORK"/ 2>/dev/null; flock "$OUT/runs.tar" tar rf runs.tar "$@" 2>/dev/null && rm -f "$@")
}
has() { [[ " $PHASES " == *" $1 "* ]]; }

if has cost && [ -n "${COST_MODEL:-}" ]; then
  log "== inspection cost: $COST_MODEL, FSDP $NGPU, compiled, fp8_current + qinit, $COST_STEPS steps"
  for every in 0 "$COST_EVERY"; do
    opts="--metrics $OUT/cost_$every.jsonl"; [ "$every" != 0 ] && opts="$opts --inspect-every $every"
    # shellcheck disable=SC2086
    timeout "${COST_TIMEOUT:-200}" torchrun --nproc-per-node "$NGPU" --master-port $((29400 + every)) \
      -m hybrid_dist.launch.train $COST_MODEL --fsdp "$NGPU" --compile --recipe fp8_current --quantized-init \
      --steps "$COST_STEPS" --log-every 100 $opts > "$OUT/cost_$every.log" 2>&1
    log "inspect-every $every: $(summary "$OUT/cost_$every.log")"
    keep "cost_$every.log"
  done
  python3 -m benchmarks.inspect_cost "$OUT/cost_0.jsonl" "$OUT/cost_$COST_EVERY.jsonl" 2>&1 | tee -a "$LOG"
  keep cost_0.jsonl "cost_$COST_EVERY.jsonl"
fi

if has inspect; then
  log "== bf16 $PRESET inspected every $INSPECT steps"
  # shellcheck disable=SC2086
  timeout "${RUN_TIMEOUT:-200}" torchrun --nproc-per-node 1 --master-port 29450 -m hybrid_dist.launch.train $RUN \
    --recipe bf16 --seed 0 --inspect-every "$INSPECT" --metrics "$OUT/inspected_bf16.jsonl" > "$OUT/inspected.log" 2>&1
  log "$(summary "$OUT/inspected.log")"
  python3 -m hybrid_dist.launch.advise "$OUT/inspected_bf16.jsonl" --min-sqnr "$MIN_SQNR" --out "$OUT/advised" \
    2>&1 | grep -E "choices|wrote" | tee -a "$LOG"
  keep inspected.log inspected_bf16.jsonl
fi

if has train; then
log "== $RECIPES x seeds ($SEEDS) on $NGPU GPUs"
jobs=()
for r in $RECIPES; do
  [ "$r" = advised ] && r="$ADVISED:recipe"
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
      keep "conv_${tag}_s$s.jsonl" "conv_${tag}_s$s.log"
    done
  ) &
done
wait
python3 -m benchmarks.convergence_table "$WORK"/conv_*.jsonl 2>&1 | tee -a "$LOG"
python3 -m hybrid_dist.launch.plot "$WORK"/conv_*_s0.jsonl --out "$OUT/advisor_losses.png" > /dev/null 2>&1 \
  || log "(loss plot skipped)"
fi
if [ -f "$WORK/inspected_bf16.jsonl" ]; then
  python3 -m hybrid_dist.launch.plot "$WORK/inspected_bf16.jsonl" --out "$OUT/inspected.png" > /dev/null 2>&1 \
    || log "(inspection plot skipped)"
fi
rm -rf "$WORK"
log "== done"
