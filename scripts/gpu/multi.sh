#!/usr/bin/env bash
# Two-GPU runs (nvidia-h200-x2) after `bash .gpubundle/setup.sh`: each case trains a Llama preset
# (SIZE, default 'small') for STEPS steps (default 30) through lowprec.Accelerator under
# `accelerate launch --multi_gpu` and writes tests/distributed/gpu_engines.py's JSON: FP8 really
# active, ranks in sync, loss, median step time and tokens/s, peak memory per rank; or, for a
# combination prepare() refuses, its message.
#   bash scripts/gpu/multi.sh OUTDIR backend[@level]:recipe:engine[:grad_comm_dtype[:steps]] ...
#   e.g. bf16::zero2 te:current:fsdp2 torchao:tensorwise:zero3 msamp@O3::fsdp2 torchao:tensorwise:ddp:fp8:300
# Each JSON has `median_step_s` (from step 5) and, with STEPS >= 26, `steady_median_step_s` (from step 18, after
# msamp's 16-step warm-up and the recompile at its end; the steps the harness measures in left out of both): msamp
# cells need it, a 20-step msamp median falls inside the warm-up. matrix_table.py shows both.
# EVAL_BATCHES=N evaluates each cell after training on N batches a rank of the corpus's held-out split (`heldout_loss`,
# the same windows in every cell; matrix_table.py sets it beside BF16's of the same engine): with STEPS=300, issue 29's
# loss of every level under its engine.
# MAIN_PORT=N: the launch's rendezvous port (two calls at once on disjoint GPUs: engine_matrix.sh GPU_GROUPS).
# CASE_TIMEOUT (s, default 300) bounds each case; COMPILE_FP8_LAYERS=true|false sets compile_fp8_layers. backend 'bf16' is the baseline without FP8; engines: ddp, fsdp2, zero1, zero2, zero3.
# NPROC=1 runs each case as a world of one on one GPU (torchrun --nproc_per_node 1): the engine's own code
# path (DDP's wrapper and hooks, FSDP2's all-gathers, DeepSpeed's ZeRO optimizer) with nothing on the wire.
# A sixth field, 'compiled' or 'eager', sets compile_fp8_layers for that cell (and names its file):
# msamp@O2::ddp:::compiled. It wins over COMPILE_FP8_LAYERS. PROFILE=1 writes each cell's CUDA kernels of one
# step (torch.profiler, by self time) beside its JSON as NAME.prof.txt (rank 0; NAME.prof.rankR.txt for the
# others), each rank's Chrome trace as NAME.prof[.rankR].trace.json.gz, and in the JSON `profiled_step`: per rank,
# kernel, NCCL, busy and span ms (gpu_profile.py; NCCL far above busy's share = a rank waiting for the other).
# Use PACK=1 with it. PEAK=1 writes what is live at one steady step's peak (step STEPS-4), by allocating line
# (benchmarks/peak_memory.py), and what the step leaves allocated, as NAME.peak.txt (rank 0; NAME.peak.rankR.txt for
# the others); PEAK_STEP=N records step N instead (1: what the first steps leave held for the rest). A sixth field 'fp8w' (te) sets
# fp8_weights=True: te:current:fsdp2:::fp8w. A sixth field 'overlap' sets LOWPREC_FP8_GRAD_OVERLAP=1 (the stored FP8
# weight gradients averaged block by block during the backward under DDP): msamp@O2::ddp:::overlap. A sixth field
# 'act8' sets activation_dtype='fp8' (the tensors autograd saves stored in FP8, issue 32): msamp@O3::fsdp2:::act8.
# 'bf16m' / 'fp8m' set optimizer_states='bf16' / 'fp8' (with fp8w: TE FusedAdam's moments): te:current:fsdp2:::fp8w+bf16m.
# 'model' compiles the whole model block by block through Accelerate (regional compilation, as torchtitan runs FP8
# under FSDP2): bf16::fsdp2:::model is the compiled baseline for torchao:tensorwise:fsdp2:::model.
# 'fused' steps torch's AdamW fused (--fused-adamw), as the one-process headline and torchtitan do: the default
# (foreach over FSDP2's DTensors) took 22 ms of a 111 ms BF16 FSDP2 step as a world of one (h200-world1-6365b0b).
# 'noag' (torchao under FSDP2) sets enable_fsdp_float8_all_gather=False: BF16 all-gathers and the cast inside the
# compiled layer, against the FP8 all-gather's cast before it (eager: aten::mul 196 calls, 16.8 ms of one step at 85a7575).
# 'aocast' (torchao under FSDP2) keeps torchao's own three-kernel cast of each shard before the FP8 all-gather, for the
# A/B of lowprec's one-kernel cast (lowprec/backends/torchao_gather.py).
# 'ingraph' (with act8 and a compiled model) sets LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=1: the compiled graphs encode what they
# save inside them, as on one process, instead of the Python hooks, an engine's default (msamp O3 under FSDP2 with FP8
# activations ran 0.86-1.13x BF16 through the hooks): msamp@O3::fsdp2:::model+act8+ingraph against ...:::model+act8.
# 'prefetch' / 'prefetch2' (under FSDP2) chain each FSDP2 group to the next one / two for forward prefetch
# (--forward-prefetch, lowprec/runtime/fsdp_prefetch.py: the all-gather issued before a group's compute, for a forward
# bound by the host): msamp@O3::fsdp2:::prefetch, te:current:fsdp2:::fp8w+prefetch.
# Several sixth-field flags join with '+' (te:current:fsdp2:::fp8w+act8, msamp@O3::fsdp2:::eager+act8); the cell's
# file names them with '_' instead.
# ROUNDS=N (default 1) runs the whole list N times in order, round r into OUTDIR/rR/ (ABAB on one machine: a ratio
# that moves between rounds is noise); matrix_table.py compares each cell with the BF16 cell of its own round.
# SEEDS="0 1 2" runs the whole list once per seed, seed S into OUTDIR/sS/ (gpu_engines.py --seed: the initial weights
# and the training windows; the held-out windows stay the same): one seed's held-out losses spread -2.6% to +2.0%
# around BF16's after 300 steps (results/gpu/2026-11-29-h200x2-matrix-9c30527), so a 1% comparison needs several;
# matrix_table.py compares each cell with BF16 of its seed and gives the mean over seeds. Not with ROUNDS > 1.
# BUDGET_S=N bounds the whole list (for a device call of 600 s: 570 leaves the packing and the table): a cell starts
# only while the time left holds the longest cell so far (CASE_TIMEOUT before the first) and is cut at the budget; the
# cells not started are listed in OUTDIR/not_started.txt. An outer `timeout` instead kills the list where it is,
# before PACK=1 and the tables (2026-11-29: the ddp part at 300 steps, 610 s, lost its table so).
# PACK=1 packs OUTDIR into OUTDIR.tgz at the end (the device tool brings back at most 8 files a call: a matrix
# with profiles writes two per cell; a file that does not come back is lost with the machine).
# FAST_EXIT=1 (the default) ends each rank with os._exit once its result is written and the process group destroyed
# (LOWPREC_HARNESS_FAST_EXIT): a cell spent 14-24 s outside the ranks' main() at 08938d9, launcher and exit together;
# the JSON's launch_started_s / launch_ended_s beside the ranks' main_started_s split that (matrix_table.py). 0 keeps
# the interpreter's own teardown.
set -uo pipefail
out=${1:?usage: multi.sh OUTDIR backend[@level]:recipe:engine...}; shift
out=${out%/}  # PACK=1 writes OUTDIR.tgz beside the folder
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rounds=${ROUNDS:-1}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a whole number >= 1, got '$rounds'" >&2; exit 2; }
[[ ${FAST_EXIT:-1} =~ ^[01]$ ]] || { echo "FAST_EXIT must be 0 or 1, got '$FAST_EXIT'" >&2; exit 2; }
budget=${BUDGET_S:-}
[ -z "$budget" ] || [[ $budget =~ ^[1-9][0-9]*$ ]] || { echo "BUDGET_S must be a whole number of seconds > 0, got" \
  "'$budget'" >&2; exit 2; }
[ -z "${MAIN_PORT:-}" ] || { [[ $MAIN_PORT =~ ^[1-9][0-9]*$ ]] && [ "$MAIN_PORT" -le 65535 ]; } || {
  echo "MAIN_PORT must be a port number from 1 to 65535, got '$MAIN_PORT'" >&2; exit 2; }
t_start=$(date +%s); longest=0
seeds=()
declare -A seen=()
for s in ${SEEDS:-}; do
  [[ $s =~ ^[0-9]+$ ]] || { echo "SEEDS must be whole numbers >= 0 separated by spaces, got '$SEEDS'" >&2; exit 2; }
  [ -z "${seen[$s]:-}" ] || { echo "SEEDS names seed $s twice ('$SEEDS'): its second run would overwrite the first" >&2; exit 2; }
  seen[$s]=1; seeds+=("$s")
done
[ ${#seeds[@]} -gt 0 ] && [ "$rounds" -gt 1 ] && { echo "SEEDS and ROUNDS > 1 cannot be combined: a round per seed is" \
  "SEEDS alone (each seed's cells against that seed's BF16, in OUTDIR/sSEED/)" >&2; exit 2; }
base=$out
passes=("${seeds[@]}"); [ ${#seeds[@]} -gt 0 ] || passes=($(seq 1 "$rounds"))
for pass in "${passes[@]}"; do
seed=""
if [ ${#seeds[@]} -gt 0 ]; then
  seed=$pass; out=$base/s$seed; mkdir -p "$out"; echo "== seed $seed"
elif [ "$rounds" -gt 1 ]; then
  out=$base/r$pass; mkdir -p "$out"; echo "== round $pass of $rounds"
fi
for case in "$@"; do
  IFS=: read -r backend recipe engine comm steps layers <<< "$case"
  compile_layers=${COMPILE_FP8_LAYERS:-}
  fp8w=""; overlap=0; act=""; states=""; whole=""; fused=""; noag=""; aocast=""; ingraph=""; prefetch=""
  IFS=+ read -ra flags <<< "$layers"
  for flag in "${flags[@]}"; do
    case "$flag" in compiled) compile_layers=true ;; eager) compile_layers=false ;; fp8w) fp8w=1 ;; overlap) overlap=1 ;;
      act8) act=fp8 ;; bf16m) states=bf16 ;; fp8m) states=fp8 ;; model) whole=1 ;; fused) fused=1 ;;
      noag) noag=1 ;; aocast) aocast=1 ;; ingraph) ingraph=1 ;; prefetch) prefetch=1 ;; prefetch2) prefetch=2 ;;
      *) echo "unknown sixth field '$flag' in '$layers' (compiled|eager|fp8w|overlap|act8|bf16m|fp8m|model|fused|noag|aocast|ingraph|prefetch|prefetch2, joined with +)" >&2
         exit 2 ;;
    esac
  done
  layers=${layers//+/_}
  level=""; [[ $backend == *@* ]] && { level=${backend#*@}; backend=${backend%@*}; }
  name="${backend}${level:+_$level}${recipe:+_$recipe}_${engine}${comm:+_$comm}${layers:+_$layers}"
  if [ -z "${imports_checked:-}" ]; then
    # before the first launch: a cell without its packages fails after ~16 s of device time each, its message deep
    # in a log ("FP8 is not available on this machine": /tmp/site not on PYTHONPATH, 2026-11-28)
    imports_checked=1
    modules=(accelerate torchao)
    for c in "$@"; do
      [[ $(cut -d: -f3 <<< "$c") == zero* ]] && modules+=(deepspeed)
      [[ ${c%%:*} == te || ${c%%:*} == te@* ]] && modules+=(transformer_engine.pytorch)
    done
    python3 -c 'import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]' "${modules[@]}" \
      2>/dev/null || { echo "multi.sh: python3 cannot import all of ${modules[*]}: on the GPU host run" \
        "'bash .gpubundle/setup.sh' and export PYTHONPATH=/tmp/site:\$PWD first" >&2; exit 2; }
  fi
  limit=${CASE_TIMEOUT:-300}
  if [ -n "$budget" ]; then
    # a cell starts only where the time left holds the longest cell of this call so far (CASE_TIMEOUT before the
    # first), and never runs past the budget: what ran is kept and packed, what did not is named
    left=$(( budget - ($(date +%s) - t_start) ))
    need=$(( longest > 0 ? longest : limit ))
    if [ "$left" -lt "$need" ]; then
      if [ "$longest" -gt 0 ]; then why="a cell took up to ${need} s"
      else why="no cell has run yet: CASE_TIMEOUT=${limit} s stands for one; set CASE_TIMEOUT to a cell's time"; fi
      echo "== $case: not started (${left} s of BUDGET_S=$budget left; $why)"
      echo "$case${seed:+ (seed $seed)}" >> "$base/not_started.txt"; continue
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $case"
  t0=$(date +%s.%N)
  if [ "${NPROC:-2}" = 1 ]; then
    launch=(torchrun --nproc_per_node 1 ${MAIN_PORT:+--master_port "$MAIN_PORT"})
    [[ $engine == zero* ]] && export ACCELERATE_USE_DEEPSPEED=true || unset ACCELERATE_USE_DEEPSPEED
  else
    launch=(accelerate launch --multi_gpu --num_processes "${NPROC:-2}" --num_machines 1 --mixed_precision fp8 --dynamo_backend no
            ${MAIN_PORT:+--main_process_port "$MAIN_PORT"})
  fi
  env LOWPREC_FP8_GRAD_OVERLAP=$overlap LOWPREC_HARNESS_FAST_EXIT="${FAST_EXIT:-1}" \
    ${ingraph:+LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=1} timeout "$limit" "${launch[@]}" \
    tests/distributed/gpu_engines.py --backend "$backend" ${recipe:+--recipe "$recipe"} ${level:+--opt-level "$level"} \
    --engine "$engine" ${comm:+--grad-comm-dtype "$comm"} --steps "${steps:-${STEPS:-30}}" --size "${SIZE:-small}" \
    ${compile_layers:+--compile-fp8-layers "$compile_layers"} ${PROFILE:+--profile "$out/$name.prof.txt"} ${PEAK:+--peak "$out/$name.peak.txt"} ${PEAK_STEP:+--peak-step "$PEAK_STEP"} ${fp8w:+--fp8-weights} ${act:+--activation-dtype "$act"} \
    ${states:+--optimizer-states "$states"} ${whole:+--compile-model} ${fused:+--fused-adamw} \
    ${noag:+--no-fp8-all-gather} ${aocast:+--torchao-gather-cast} ${prefetch:+--forward-prefetch "$prefetch"} \
    ${EVAL_BATCHES:+--eval-batches "$EVAL_BATCHES"} ${seed:+--seed "$seed"} --out "$out/$name.json" > "$out/$name.log" 2>&1
  rc=$?; t1=$(date +%s.%N); took=$(( ${t1%.*} - ${t0%.*} )); echo "exit $rc in $took s"
  [ "$took" -gt "$longest" ] && longest=$took
  if [ -s "$out/$name.json" ]; then  # a result dict that raised leaves an empty file: keep the log then
    # the launch's wall time beside the ranks' own timeline: matrix_table.py gives what lies outside main()
    # and its start and end on the wall clock, which split that into the launcher's start and the exit
    python3 -c 'import json, sys; p = sys.argv[1]; d = json.load(open(p)); d["launch_wall_s"] = int(sys.argv[2]);
d["launch_started_s"], d["launch_ended_s"] = round(float(sys.argv[3]), 2), round(float(sys.argv[4]), 2);
json.dump(d, open(p, "w"), indent=1)' "$out/$name.json" "$took" "$t0" "$t1" || echo "could not add launch_wall_s to $name.json"
    grep -E '"(refused|all_forwards_in_fp8|first_loss|last_loss|median_step_s|tokens_per_s|max_param_diff_across_ranks|delayed_scaling_differs_across_ranks)"' \
      "$out/$name.json"; rm -f "$out/$name.log"  # keep logs of failures only
  else
    grep -E "Error|error" "$out/$name.log" | grep -v "W1\|Warn" | tail -5
  fi
done
done
out=$base
if [ "${PACK:-0}" = 1 ]; then
  tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
fi
