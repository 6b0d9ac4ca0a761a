#!/usr/bin/env bash
# GPU check of the foundation (issue 2) on a Hopper host, after `bash .gpubundle/setup.sh`:
# the GPU test suite, then the demo (BF16 vs FP8, compiled, d=4096 proxy) for torchao recipes;
# each demo keeps its summary.json (both runs, with plan) and its printed table.
#   bash scripts/gpu/foundation.sh OUTDIR [recipe ...]
set -uo pipefail
out=${1:?usage: foundation.sh OUTDIR [recipe ...]}; shift
recipes=${*:-tensorwise}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, accelerate, torchao, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "| accelerate", accelerate.__version__, "| torchao", torchao.__version__, "| transformers", transformers.__version__)'
} > "$out/host.txt" 2>&1
cat "$out/host.txt"
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rA 2>&1 | tee "$out/pytest_gpu.txt" | tail -25
for r in $recipes; do
  python3 -m lowprec.cli demo --backend torchao --recipe "$r" --out "$out/demo_$r" --no-progress 2>&1 | tee "$out/demo_$r.txt" | tail -12
  rm -f "$out/demo_$r/bf16.json" "$out/demo_$r/fp8.json"  # summary.json holds both
done
