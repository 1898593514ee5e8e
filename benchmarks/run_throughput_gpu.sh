#!/usr/bin/env bash
# Throughput benchmark on one host with NGPU GPUs (default 4; NCCL is picked by the
# launcher): `torchrun -m hybrid_dist.launch.train` with FSDP=NGPU for a 16-block 8b (1 x 8192
# and 1 x 4096 tokens per GPU) and the 1b (4 x 2048): bf16 eager and compiled, torchao float8
# tensorwise compiled (`--baseline torchao-float8 --compile`, skipped when torchao does not
# import), hd fp8_current and fp8_delayed with --quantized-init (float8 all-gather) eager and
# compiled, mxfp8_fwd_nvfp4_bwd compiled; then MoE variants and other recipes. Each run: STEPS steps, the first 2
# left out of tokens/s (--timing-warmup 2); metrics JSONL and log per run in $OUT; at the
# end ONE markdown table (python -m benchmarks.throughput) in $OUT/throughput.md.
#
# Runs go in priority order and none starts once BUDGET_S seconds have passed (default
# 400 s, so the script ends within ~7 min); runs left out appear as "(skipped)" rows.
# ONLY=REGEX runs only the runs whose name matches (e.g. ONLY='^1b' for a second run that
# fills in the skipped 1b rows; earlier files are kept, so the table covers both calls);
# SKIP=REGEX leaves out matching runs; M8B/M1B/MOE override the model options (CPU check:
# NGPU=2 INSTALL=0 SKIP=compile M8B="--preset tiny --batch-size 2 --seq-len 64" ...).
# A failing run (crash, timeout, OOM) is reported with the tail of its log and the script
# goes on. ROUNDS=N (default 1) runs the selected plan N times over, each configuration once
# per round in turn (files thr_NAME.r<k>.jsonl): the table then gives per configuration the
# median tokens/s and the median of the per-round ratios, for steps bound by a host whose
# speed drifts between runs (the 1b). TORCHRUN_ARGS adds options to every torchrun (e.g.
# "--numa-binding exclusive": each rank on its own share of its GPU's NUMA node's cores).
#
#   OUT=gpu_logs bash benchmarks/run_throughput_gpu.sh
set -o pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
NGPU=${NGPU:-4}
STEPS=${STEPS:-6}
BUDGET_S=${BUDGET_S:-400}
ONLY=${ONLY:-}
SKIP=${SKIP:-}
ROUNDS=${ROUNDS:-1}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
[ "${INSTALL:-1}" = 1 ] && python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/thr_gpus.txt"
[ -z "$ONLY" ] && rm -f "$OUT"/thr_*.jsonl "$OUT"/thr_*.log
# torchao is optional: a wheel carried in .whl/ (ignored by git; pass carry=[".whl"]) is installed if needed
if ! python3 -c "import torchao.float8" > /dev/null 2>&1 && ls .whl/torchao-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .whl/torchao-*.whl 2>&1 | tail -1; fi
if python3 -c "import torchao.float8" > /dev/null 2>&1; then TORCHAO=1; else TORCHAO=0
  echo "torchao.float8 does not import here: the torchao-float8 rows are skipped"; fi

# model shapes (tokens per GPU): a 16-block 8b at 1 x 8192 (torchtitan's Llama-3-8B setting) and
# 1 x 4096, the 1b at 4 x 2048; then MoE variants (8 experts, top-2) and the other recipes
M8B=${M8B:-"--preset 8b --layers 16 --batch-size 1 --seq-len 8192"}
M8B4K=${M8B4K:-"--preset 8b --layers 16 --batch-size 1 --seq-len 4096"}
M1B=${M1B:-"--preset 1b --batch-size 4 --seq-len 2048"}
MOE=${MOE:-"--preset 1b --moe-experts 8 --moe-top-k 2 --batch-size 2 --seq-len 2048"}
MOE8B=${MOE8B:-"--preset 8b --layers 4 --moe-experts 8 --moe-top-k 2 --batch-size 1 --seq-len 4096"}
QI="--recipe fp8_current --quantized-init"
QD="--recipe fp8_delayed --quantized-init"
TAO="--baseline torchao-float8 --compile"
# name | time cap (s) | needs torchao | launcher options   (priority order)
end_to_end_rows() {  # end_to_end_rows PREFIX "MODEL OPTIONS" CAP: the eight rows of one model
  local p=$1 m=$2 c=$3
  printf '%s\n' "${p}_bf16_compile|$c|0|$m --recipe bf16 --compile" "${p}_torchao_float8_compile|$c|1|$m $TAO" \
    "${p}_fp8_current_qinit_compile|$c|0|$m $QI --compile" "${p}_fp8_current_qinit|$c|0|$m $QI" \
    "${p}_mxfp8_fwd_nvfp4_bwd_compile|$c|0|$m --recipe mxfp8_fwd_nvfp4_bwd --compile" \
    "${p}_fp8_delayed_qinit_compile|$c|0|$m $QD --compile" "${p}_bf16|$c|0|$m --recipe bf16" \
    "${p}_fp8_delayed_qinit|$c|0|$m $QD"
}
PLAN="
$(end_to_end_rows 8b "$M8B" 150)
$(end_to_end_rows 1b "$M1B" 120)
$(end_to_end_rows 8b4k "$M8B4K" 150)
1b_nr_bf16_compile|120|0|$M1B --reshard-after-forward never --recipe bf16 --compile
1b_nr_torchao_float8_compile|120|1|$M1B --reshard-after-forward never $TAO
1b_nr_fp8_current_qinit_compile|120|0|$M1B --reshard-after-forward never $QI --compile
1b_u1_bf16_compile|120|0|$M1B --fsdp-unit 1 --recipe bf16 --compile
1b_u1_torchao_float8_compile|120|1|$M1B --fsdp-unit 1 $TAO
1b_u1_fp8_current_qinit_compile|120|0|$M1B --fsdp-unit 1 $QI --compile
8b_pf1_fp8_current_qinit_compile|150|0|$M8B --fsdp-prefetch 1 $QI --compile
8b_pf1_torchao_float8_compile|150|1|$M8B --fsdp-prefetch 1 $TAO
1b_moe8_bf16|75|0|$MOE --recipe bf16
1b_moe8_fp8_current|75|0|$MOE --recipe fp8_current
1b_moe8_bf16_compile|100|0|$MOE --recipe bf16 --compile
1b_moe8_fp8_current_compile|100|0|$MOE --recipe fp8_current --compile
1b_moe8_fp8_current_qinit_compile|100|0|$MOE --recipe fp8_current --quantized-init --compile
8b_mxfp8_fwd_nvfp4_bwd|120|0|$M8B --recipe mxfp8_fwd_nvfp4_bwd
8b_mxfp8_fwd_nvfp4_bwd_qinit_compile|150|0|$M8B --recipe mxfp8_fwd_nvfp4_bwd --quantized-init --compile
8b_nvfp4|120|0|$M8B --recipe nvfp4
1b_moe8_mxfp8_fwd_nvfp4_bwd|90|0|$MOE --recipe mxfp8_fwd_nvfp4_bwd
8b_L4_moe8_bf16|75|0|$MOE8B --recipe bf16
8b_L4_moe8_fp8_current|75|0|$MOE8B --recipe fp8_current
8b_L4_moe8_bf16_compile|100|0|$MOE8B --recipe bf16 --compile
8b_L4_moe8_fp8_current_compile|100|0|$MOE8B --recipe fp8_current --compile
8b_L4_moe8_fp8_current_qinit_compile|100|0|$MOE8B --recipe fp8_current --quantized-init --compile
"


stub() {  # stub NAME STATUS OPTIONS: a start record, so the table shows a run that never started
  python3 - "$OUT/thr_$1.jsonl" "$1" "$2" $3 <<'EOF'
import argparse, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("presets", "launch/presets.py")  # no torch import: fast
presets = sys.modules["presets"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(presets)
path, name, status, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
p = argparse.ArgumentParser()
for flag, kw in (("--preset", {}), ("--recipe", {"default": "bf16"}), ("--baseline", {"default": "none"}),
                 ("--layers", {"type": int, "default": 0}), ("--moe-experts", {"type": int, "default": 0}),
                 ("--moe-top-k", {"type": int, "default": 2}), ("--fsdp", {"type": int}),
                 ("--reshard-after-forward", {"default": "default"})):
    p.add_argument(flag, **kw)
for flag in ("--quantized-init", "--compile"):
    p.add_argument(flag, action="store_true")
a, _ = p.parse_known_args(argv)
rec = {"event": "start", "name": name, "status": status, "preset": a.preset, "recipe": a.recipe,
       "n_layers": a.layers or presets.PRESETS[a.preset].n_layers, "baseline": a.baseline,
       "quantized_init": a.quantized_init, "compile": a.compile, "moe_experts": a.moe_experts,
       "moe_top_k": a.moe_top_k, "fsdp": a.fsdp, "reshard_after_forward": a.reshard_after_forward}
with open(path, "w") as f:
    f.write(json.dumps(rec) + "\n")
EOF
}

port=29600
for round in $(seq 1 "$ROUNDS"); do
sfx=""; [ "$ROUNDS" -gt 1 ] && sfx=".r$round"
while IFS='|' read -r name cap needs_tao opts; do
  [ -z "$name" ] && continue
  [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]] && continue
  [ -n "$SKIP" ] && [[ $name =~ $SKIP ]] && continue
  f="$OUT/thr_$name$sfx.jsonl"; log="$OUT/thr_$name$sfx.log"
  rm -f "$f" "$log"
  if [ "$needs_tao" = 1 ] && [ "$TORCHAO" = 0 ]; then stub "$name$sfx" "no torchao" "$opts --fsdp $NGPU"; continue; fi
  left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 30 ]; then stub "$name$sfx" skipped "$opts --fsdp $NGPU"; echo "-- $name$sfx: skipped (budget)"; continue; fi
  [ "$cap" -gt "$left" ] && cap=$left
  port=$((port + 1)); t0=$SECONDS
  # shellcheck disable=SC2086
  timeout -k 30 "$cap" torchrun --nproc-per-node "$NGPU" --master-port "$port" ${TORCHRUN_ARGS:-} -m hybrid_dist.launch.train \
    $opts --fsdp "$NGPU" --steps "$STEPS" --timing-warmup 2 --run-name "$name" --metrics "$f" < /dev/null > "$log" 2>&1
  rc=$?
  if [ "$rc" = 0 ] || grep -q '"event": "summary"' "$f" 2> /dev/null; then
    [ "$rc" = 0 ] || echo "   ($name exited with rc=$rc after writing its summary)"
    echo "-- $name$sfx ($((SECONDS - t0)) s): $(grep '^summary:' "$log" | tail -n 1)"
  else
    [ -f "$f" ] || stub "$name$sfx" "failed rc=$rc" "$opts --fsdp $NGPU"
    echo "-- $name$sfx FAILED (rc=$rc after $((SECONDS - t0)) s; 124 = timeout after ${cap} s); errors in $log:"
    grep -E "Error|Exception|error:" "$log" | grep -v "ChildFailedError\|^W1\|^\[W" | head -n 6 | sed 's/^/     /'
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then  # workers may outlive torchrun: end any left on the GPUs
      sleep 3
      for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2> /dev/null); do
        kill -9 "$pid" 2> /dev/null && echo "   killed leftover GPU process $pid"
      done
    fi
  fi
done <<< "$PLAN"
done

echo "total wall: ${SECONDS} s"
files=()  # in plan order (also those of earlier calls with ONLY), every round
while IFS='|' read -r name _; do
  [ -z "$name" ] && continue
  for f in "$OUT/thr_$name.jsonl" "$OUT/thr_$name".r*.jsonl; do [ -f "$f" ] && files+=("$f"); done
done <<< "$PLAN"
if [ "${#files[@]}" = 0 ]; then echo "no runs selected"; exit 1; fi
python3 -m benchmarks.throughput "${files[@]}" | tee "$OUT/throughput.md"
