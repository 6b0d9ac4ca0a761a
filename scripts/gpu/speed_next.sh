#!/usr/bin/env bash
# The speed measurements issue 18 left open (docs/performance.md "Not measured yet"), for one H100 after
#   bash .gpubundle/setup.sh && export PYTHONPATH=/tmp/site:$PWD NVTE_FRAMEWORK=pytorch PYTHONUNBUFFERED=1
# each writing raw JSON and its log under OUTDIR:
#   bash scripts/gpu/speed_next.sh OUTDIR [te-compiled|te-loss|d1024|all]
# te-compiled: TE with its compiled-model rules (d2048 kept in BF16, the model's norms kept) against
#              compiled BF16; measured before the rules: 0.51-0.64 / 1.14 / 1.39 at d2048 / d4096 / d8192;
#              first the GPU test of those rules (written without a GPU at hand)
# te-loss:     TE's held-out loss with the head in FP8, eager (its fast mode), against eager BF16, on the
#              d4096 proxy with a 64K-row head, as results/gpu/2026-11-23-h100-speed-head measured the others
# d1024:       the BF16-identical d1024 model under lowprec against BF16, four rounds in ABBA order
#              (single runs measured 0.92-0.97: order, or noise of the host-bound step?)
set -uo pipefail
out=${1:?usage: speed_next.sh OUTDIR [te-compiled|te-loss|d1024|all]}; what=${2:-all}
mkdir -p "$out"
if [[ $what == te-compiled || $what == all ]]; then
  python3 -m pytest -m gpu -q tests/gpu/test_te_gpu.py -k compiled_model_keeps > "$out/pytest_te_compiled.txt" 2>&1
  python3 benchmarks/widths.py --widths d2048 d4096 d8192 --configs bf16 "te default" --rounds 2 \
    --steps 16 --warmup 8 --out "$out/te_compiled_rules.json" > "$out/te_compiled_rules.log" 2>&1
fi
if [[ $what == te-loss || $what == all ]]; then
  for variant in bf16 fp8; do
    python3 -m lowprec.demo.run --variant $variant --backend te --size proxy --steps 300 --tokens pairs \
      --no-compile --no-progress --json "$out/conv_te_$variant.json" > "$out/conv_te_$variant.log" 2>&1
  done
fi
if [[ $what == d1024 || $what == all ]]; then
  python3 benchmarks/widths.py --widths d1024 --configs bf16 "torchao default" --rounds 4 --steps 28 --warmup 18 \
    --out "$out/d1024_rounds.json" > "$out/d1024_rounds.log" 2>&1
fi
ls -la "$out"
