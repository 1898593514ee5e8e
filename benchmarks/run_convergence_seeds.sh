#!/usr/bin/env bash
# Multi-seed convergence study on ONE GPU: the 125m preset for STEPS steps (cosine over
# STEPS), every (recipe, seed) pair as its own single-rank run, all at once on the same
# GPU (a 125m step is host-bound, so they share it well). EXTRA recipes run with seed 0
# only; an EXTRA entry "NAME+rerun" runs NAME again as "NAME-rerun" (same seed, same
# code: shows how far run-to-run nondeterminism moves the loss). Then one table and one
# plot (seed 0). BATCH, LR: sequences per step and peak learning rate.
#   RECIPES="bf16 fp8_current" SEEDS="0 1 2" STEPS=500 \
#   EXTRA="benchmarks.diag_recipes:fp8_input_only" bash benchmarks/run_convergence_seeds.sh
set -o pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
STEPS=${STEPS:-500}; BATCH=${BATCH:-8}; LR=${LR:-1e-3}; PRESET=${PRESET:-125m}; SEQ=${SEQ:-512}; SEEDS=${SEEDS:-"0 1 2"}; RECIPES=${RECIPES:-"bf16 fp8_current"}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
port=${PORT:-29600}
pairs=$(for r in $RECIPES; do for s in $SEEDS; do echo "$r,$s"; done; done; for r in ${EXTRA:-}; do echo "$r,0"; done)
for pair in $pairs; do
    r=${pair%,*}; s=${pair##*,}
    tag=${r##*:}  # a module:attr recipe is named by its attr
    if [[ $r == *+rerun ]]; then r=${r%+rerun}; tag=${tag%+rerun}-rerun; fi
    timeout ${CONV_TIMEOUT:-420} torchrun --nproc-per-node 1 --master-port $port \
      -m hybrid_dist.launch.train --preset "$PRESET" --recipe "$r" --seed "$s" --steps "$STEPS" --batch-size "$BATCH" \
      --seq-len "$SEQ" --lr "$LR" --log-every 100 --metrics "$OUT/conv_${tag}_s$s.jsonl" \
      > "$OUT/conv_${tag}_s$s.log" 2>&1 &
    port=$((port + 1))
done
wait
for f in "$OUT"/conv_*.log; do echo "== $f"; grep -v "^W1" "$f" | tail -n 4; done > "$OUT/convergence_runs.log"
rm -f "$OUT"/conv_*.log
python3 -m benchmarks.convergence_table "$OUT"/conv_*.jsonl | tee "$OUT/convergence_table.md"
python3 -m hybrid_dist.launch.plot "$OUT"/conv_*_s0.jsonl --out "$OUT/convergence.png" || echo "(plot skipped)"
# one archive for the per-run JSONL files
tar czf "$OUT/conv_jsonl.tgz" -C "$OUT" $(cd "$OUT" && ls conv_*.jsonl) && rm -f "$OUT"/conv_*.jsonl
