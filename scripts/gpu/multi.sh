#!/usr/bin/env bash
# Two-GPU checks (nvidia-h200-x2) after `bash .gpubundle/setup.sh`: each case trains the 'small'
# Llama for 30 steps through lowprec.Accelerator under `accelerate launch --multi_gpu` and writes
# tests/distributed/gpu_engines.py's evidence JSON (FP8 really active, ranks in sync, loss falling).
#   bash scripts/gpu/multi.sh OUTDIR backend:recipe:engine[:grad_comm_dtype[:steps]] ...
#   e.g. te:current:fsdp2 torchao:tensorwise:fsdp2 torchao:tensorwise:ddp:fp8:300
set -uo pipefail
out=${1:?usage: multi.sh OUTDIR backend:recipe:engine...}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for case in "$@"; do
  IFS=: read -r backend recipe engine comm steps <<< "$case"
  name="${backend}_${recipe}_${engine}${comm:+_$comm}"
  echo "== $case"
  accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision fp8 --dynamo_backend no \
    tests/distributed/gpu_engines.py --backend "$backend" --recipe "$recipe" --engine "$engine" \
    ${comm:+--grad-comm-dtype "$comm"} --steps "${steps:-30}" --out "$out/$name.json" > "$out/$name.log" 2>&1
  rc=$?; echo "exit $rc"
  if [ -f "$out/$name.json" ]; then
    grep -v '^  *-\?[0-9]' "$out/$name.json"; rm -f "$out/$name.log"  # keep logs of failures only
  else
    grep -E "Error|error" "$out/$name.log" | grep -v "W1\|Warn" | tail -5
  fi
done
