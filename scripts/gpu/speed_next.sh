#!/usr/bin/env bash
# The next GPU measurements of the speed issue (one H100, after `bash .gpubundle/setup.sh` and
# `export PYTHONPATH=/tmp/site:$PWD NVTE_FRAMEWORK=pytorch`), each writing raw JSON under OUTDIR:
#   bash scripts/gpu/speed_next.sh OUTDIR [head|msamp-compile|all]
# head:          does the output head in FP8 keep held-out loss within 1% of BF16 on the d4096 proxy?
#                (skip_first_last=False converts it; 1.41x vs 1.33x at d8192 compiled, see docs/performance.md)
# msamp-compile: msamp O2 with its layers compiled at d4096, dynamo verbose, to find the AssertionError that
#                keeps msamp's compile_fp8_layers off by default (results/gpu/2026-11-23-h100-eager-layers)
set -uo pipefail
out=${1:?usage: speed_next.sh OUTDIR [head|msamp-compile|all]}; what=${2:-all}
mkdir -p "$out"
if [[ $what == head || $what == all ]]; then
  lowprec bench --configs bf16 torchao:tensorwise --size proxy --convergence --steps 300 --no-raw \
    --out "$out/head_bf16_default" > "$out/head_bf16_default.log" 2>&1
  ACCELERATE_FP8_SKIP_FIRST_LAST=false lowprec bench --configs torchao:tensorwise --size proxy --convergence \
    --steps 300 --no-raw --out "$out/head_fp8" > "$out/head_fp8.log" 2>&1
fi
if [[ $what == msamp-compile || $what == all ]]; then
  TORCHDYNAMO_VERBOSE=1 python3 benchmarks/eager_layers.py --size proxy --steps 6 --warmup 2 \
    --runs "msamp O2 eager, FP8 layers compiled" --out "$out/msamp_compile.json" > "$out/msamp_compile.log" 2>&1
fi
ls -la "$out"
