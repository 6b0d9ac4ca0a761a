#!/usr/bin/env bash
# Two-GPU checks (nvidia-h200-x2) after `bash .gpubundle/setup.sh`: each case trains the 'small'
# Llama for 30 steps through lowprec.Accelerator under `accelerate launch --multi_gpu` and writes
# tests/distributed/gpu_engines.py's evidence JSON (FP8 really active, ranks in sync, loss falling).
#   bash scripts/gpu/multi.sh OUTDIR backend:recipe:engine ...     e.g. te:current:fsdp2 torchao:tensorwise:fsdp2
set -uo pipefail
out=${1:?usage: multi.sh OUTDIR backend:recipe:engine...}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for case in "$@"; do
  IFS=: read -r backend recipe engine <<< "$case"
  echo "== $case"
  accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision fp8 --dynamo_backend no \
    tests/distributed/gpu_engines.py --backend "$backend" --recipe "$recipe" --engine "$engine" \
    --out "$out/${backend}_${recipe}_${engine}.json" > "$out/${backend}_${recipe}_${engine}.log" 2>&1
  rc=$?; echo "exit $rc"
  if [ -f "$out/${backend}_${recipe}_${engine}.json" ]; then
    cat "$out/${backend}_${recipe}_${engine}.json"; rm -f "$out/${backend}_${recipe}_${engine}.log"  # keep logs of failures only
  else
    grep -E "Error|error" "$out/${backend}_${recipe}_${engine}.log" | grep -v "W1\|Warn" | tail -5
  fi
done
