#!/usr/bin/env bash
# GPU check of the TE backend (issue 3) on a Hopper host with the TE bundle set up
# (`bash .gpubundle/setup.sh`). Parts, each writing into OUTDIR:
#   tests  - pytest -m gpu tests/gpu (torchao and TE GPU tests)
#   bench  - benchmarks/te_overhead.py: BF16, raw TE and lowprec's TE backend, per recipe, same process
#   demo   - lowprec demo with the TE backend (BF16 vs FP8, d=4096 proxy)
#   bash scripts/gpu/te.sh OUTDIR tests|bench|demo [...]
set -uo pipefail
out=${1:?usage: te.sh OUTDIR part...}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for part in "$@"; do
  case "$part" in
    tests) python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rA 2>&1 | tee "$out/pytest_gpu.txt" | tail -40 ;;
    bench) python3 benchmarks/te_overhead.py --out "$out/te_overhead.json" 2>&1 | tee "$out/te_overhead.txt" | grep -v "^W1" | tail -20 ;;
    demo)  python3 -m lowprec.cli demo --backend te --recipe current --out "$out/demo_te" --no-progress 2>&1 \
             | tee "$out/demo_te.txt" | tail -12
           rm -f "$out/demo_te/bf16.json" "$out/demo_te/fp8.json" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
