#!/usr/bin/env bash
# One full run on a multi-GPU host (2-4 GPUs, NCCL): the gpu-marked distributed and
# MoE tests, then the FSDP2 and TP benchmarks. Logs go to $OUT (or ./gpu_logs).
set -o pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests_distributed tests/moe 2>&1 | tee "$OUT/dist_tests.log"
timeout 170 torchrun --nproc_per_node "$NGPU" -m benchmarks.fsdp2 2>&1 | grep -v "^W1" | tee "$OUT/fsdp2_bench.log"
timeout 90 torchrun --nproc_per_node "$NGPU" -m benchmarks.tp 2>&1 | grep -v "^W1" | tee "$OUT/tp_bench.log"
