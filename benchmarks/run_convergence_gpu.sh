#!/usr/bin/env bash
# Convergence, one seed per recipe: the 125m preset for STEPS steps under four recipes, one
# recipe per GPU in parallel (each a single-GPU run), then one plot. Logs and JSONL go to $OUT.
set -o pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
STEPS=${STEPS:-1000}
export PYTHONUNBUFFERED=1
i=0
for r in bf16 fp8_current mxfp8_fwd_nvfp4_bwd nvfp4; do
  CUDA_VISIBLE_DEVICES=$i timeout ${CONV_TIMEOUT:-330} torchrun --nproc-per-node 1 --master-port $((29500 + i)) \
    -m hybrid_dist.launch.train --preset 125m --recipe $r --steps $STEPS --batch-size 8 --seq-len 512 \
    --lr 1e-3 --log-every 100 --metrics "$OUT/conv_$r.jsonl" > "$OUT/conv_$r.log" 2>&1 &
  i=$((i + 1))
done
wait
for f in "$OUT"/conv_*.log; do echo "== $f"; grep -v "^W1" "$f" | tail -n 14; done > "$OUT/convergence.log"
rm -f "$OUT"/conv_*.log
cat "$OUT/convergence.log"
python3 -m hybrid_dist.launch.plot "$OUT"/conv_*.jsonl --out "$OUT/convergence.png" || echo "(plot skipped: no matplotlib here)"
