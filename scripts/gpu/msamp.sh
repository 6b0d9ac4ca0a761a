#!/usr/bin/env bash
# GPU check of the MS-AMP levels (issue 4) on a Hopper host after `bash <bundle>/setup.sh` (TE not
# needed: a bundle with only the torchao wheel and setup.sh is enough). Parts, each writing into OUTDIR:
#   tests  - pytest -m gpu tests/gpu/test_msamp_gpu.py tests/gpu/test_torchao_gpu.py
#   bench  - benchmarks/levels.py: BF16, torchao tensorwise, msamp O1 and O2 on the d=4096 proxy, same process
#   demo   - lowprec demo --backend msamp (BF16 then FP8 O2 on the proxy, loss curves)
#   comm   - benchmarks/fp8_comm.py on all GPUs of the host (all_to_all vs NCCL FP8 all_reduce)
#   ddp    - tests/distributed/gpu_engines.py with msamp O1 and O2 under DDP (2 GPUs)
#   bash scripts/gpu/msamp.sh OUTDIR tests|bench|demo|comm|ddp [...]
set -uo pipefail
out=${1:?usage: msamp.sh OUTDIR part...}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for part in "$@"; do
  case "$part" in
    tests) python3 -m pytest -m gpu tests/gpu/test_msamp_gpu.py tests/gpu/test_torchao_gpu.py -q -p no:cacheprovider -rA \
             2>&1 | tee "$out/pytest_gpu.txt" | tail -30 ;;
    bench) python3 benchmarks/levels.py --runs bf16 "torchao tensorwise" "msamp O1" "msamp O2" --out "$out/msamp_bench.json" 2>&1 | tee "$out/msamp_bench.txt" \
             | grep -v "^W1" | tail -12 ;;
    demo)  python3 -m lowprec.cli demo --backend msamp --opt-level O2 --out "$out/demo_msamp" --no-progress 2>&1 \
             | tee "$out/demo_msamp.txt" | tail -8 ;;
    comm)  torchrun --nproc_per_node "$(nvidia-smi -L | wc -l)" benchmarks/fp8_comm.py --out "$out/fp8_comm.json" \
             > "$out/fp8_comm.txt" 2>&1; tail -30 "$out/fp8_comm.txt" ;;
    ddp)   for level in O1 O2; do
             accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision fp8 --dynamo_backend no \
               tests/distributed/gpu_engines.py --backend msamp --opt-level "$level" --engine ddp \
               --out "$out/msamp_${level}_ddp.json" > "$out/msamp_${level}_ddp.log" 2>&1
             echo "ddp $level exit $?"
             if [ -f "$out/msamp_${level}_ddp.json" ]; then cat "$out/msamp_${level}_ddp.json"; rm -f "$out/msamp_${level}_ddp.log"
             else grep -E "Error|error" "$out/msamp_${level}_ddp.log" | grep -v "W1\|Warn" | tail -5; fi
           done ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
