#!/usr/bin/env bash
# Issue 29's engine matrix (item 5) on two GPUs (nvidia-h200-x2), after `bash .gpubundle/setup.sh` (TE's extension
# built) and `export PYTHONPATH=/tmp/site:$PWD NVTE_FRAMEWORK=pytorch`: every backend x level x engine on the d4096
# proxy through scripts/gpu/multi.sh, each part against BF16 of its own engine and mode in the same call, with
# matrix_table.py's table (speed, peak per rank, model-state bytes per parameter per rank beside the plan's).
#
#   COMMIT=<hash> bash scripts/gpu/engine_matrix.sh OUT PART [PART ...]
#
# Parts and their cells; the seconds are what such cells took on two H200s at 3ee32b5 (45-105 s a cell: launch,
# compiles, 30 steps), so that the parts of one device call stay inside its 600 s:
#   ddp        (~370 s) bf16, te current, torchao tensorwise, msamp O1, msamp O2
#   ddp_levels (~300 s) bf16, torchao O1, torchao O2, te O2
#   fsdp2      (~300 s) bf16, te current, te current with fp8_weights, torchao tensorwise, msamp O3
#   zero       (~420 s) ZeRO-1 and ZeRO-2: bf16, torchao tensorwise, msamp O3; ZeRO-2: te current
#   zero1, zero2        zero's ZeRO-1 and ZeRO-2 cells, each with its BF16: a part a call at 300 steps, where zero's
#                       seven cells (90-150 s each) pass one call's 600 s
#   zero3      (~170 s) bf16, te current, torchao tensorwise
#   compiled   (~250 s) the model compiled block by block, fused AdamW: bf16 and torchao under FSDP2; bf16 and
#                       msamp O2 under DDP
# Each part writes OUT/PART/ (the cells' JSONs, a failed cell's log, table.md) and, with PACK=1 (the default here),
# OUT/PART.tgz instead: the device tool brings back 8 files a call. STEPS (30), SIZE (proxy) and CASE_TIMEOUT (150;
# 220 past 30 steps) pass to multi.sh, and EVAL_BATCHES (unset: none) too: each cell's held-out loss after training,
# beside BF16's of its engine in the table (STEPS=300 EVAL_BATCHES=8: the loss of every level under its engine; at
# 9c30527 fsdp2 took 480 s and ddp 610 s so, 90-180 s a cell: a part a call at most, ddp's last cell in a call of
# its own), and SEEDS too (each seed's cells in PART/sS/ against BF16 of that seed, and the mean: one seed's held-out
# losses spread -2.6% to +2.0% around BF16's, results/gpu/2026-11-29-h200x2-matrix-9c30527). DRY=1 prints each part's
# multi.sh command (with the CASE_TIMEOUT it gets) instead of running it. BUDGET_S bounds all the parts named
# (multi.sh's: a cell starts only where the time left holds it, each part's table and packing still made, the cells
# not started in PART/not_started.txt): BUDGET_S=570 in a 600 s call.
# GPU_GROUPS="0,1 2,3" (on nvidia-h200-x4) runs the parts at once, one GPU pair each, the parts dealt to the pairs in
# turn (each pair runs its own one after another, its own rendezvous port, its output in OUT/gpusN.log, printed at
# the end); every cell's ratio is still against BF16 of its own part on the same pair, and BUDGET_S bounds each pair.
set -uo pipefail
out=${1:?usage: engine_matrix.sh OUT PART [PART ...] (ddp ddp_levels fsdp2 zero zero1 zero2 zero3 compiled)}; shift
[ $# -gt 0 ] || { echo "name at least one part: ddp ddp_levels fsdp2 zero zero1 zero2 zero3 compiled" >&2; exit 2; }
cd "$(dirname "$0")/../.."
[ -z "${BUDGET_S:-}" ] || [[ $BUDGET_S =~ ^[1-9][0-9]*$ ]] || { echo "BUDGET_S must be a whole number of seconds > 0," \
  "got '$BUDGET_S'" >&2; exit 2; }
run_part() {  # one part: its cells through multi.sh, its table, packed
  local part=$1 cells budget case_timeout status=0
  case "$part" in
    ddp) cells="bf16::ddp te:current:ddp torchao:tensorwise:ddp msamp@O1::ddp msamp@O2::ddp" ;;
    ddp_levels) cells="bf16::ddp torchao@O1:tensorwise:ddp torchao@O2:tensorwise:ddp te@O2:current:ddp" ;;
    fsdp2) cells="bf16::fsdp2 te:current:fsdp2 te:current:fsdp2:::fp8w torchao:tensorwise:fsdp2 msamp@O3::fsdp2" ;;
    zero) cells="bf16::zero1 torchao:tensorwise:zero1 msamp@O3::zero1 bf16::zero2 torchao:tensorwise:zero2
                 te:current:zero2 msamp@O3::zero2" ;;
    zero1) cells="bf16::zero1 torchao:tensorwise:zero1 msamp@O3::zero1" ;;
    zero2) cells="bf16::zero2 torchao:tensorwise:zero2 te:current:zero2 msamp@O3::zero2" ;;
    zero3) cells="bf16::zero3 te:current:zero3 torchao:tensorwise:zero3" ;;
    compiled) cells="bf16::fsdp2:::model+fused torchao:tensorwise:fsdp2:::model+fused bf16::ddp:::model
                     msamp@O2::ddp:::model" ;;
    *) echo "unknown part '$part' (ddp ddp_levels fsdp2 zero zero1 zero2 zero3 compiled)" >&2; return 2 ;;
  esac
  # 300 steps took a cell up to 152 s at bdbfff9 (msamp O1 under DDP, killed at its exit by a 150 s limit)
  case_timeout=${CASE_TIMEOUT:-$(( ${STEPS:-30} > 30 ? 220 : 150 ))}
  # shellcheck disable=SC2086  # the cells are words
  if [ "${DRY:-0}" = 1 ]; then
    echo "${MAIN_PORT:+CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-} MAIN_PORT=$MAIN_PORT }"` \
      `"CASE_TIMEOUT=$case_timeout multi.sh $out/$part" $cells; return 0
  fi
  budget=""
  if [ -n "${BUDGET_S:-}" ]; then  # what the parts before left of the whole call's budget (at least 1 s: multi.sh
    budget=$(( BUDGET_S - ($(date +%s) - start) )); [ "$budget" -ge 1 ] || budget=1  # then names every cell)
  fi
  STEPS=${STEPS:-30} SIZE=${SIZE:-proxy} CASE_TIMEOUT=$case_timeout PACK=0 BUDGET_S=$budget \
    bash scripts/gpu/multi.sh "$out/$part" $cells || status=1
  python3 scripts/gpu/matrix_table.py "$out/$part" > "$out/$part/table.md" || status=1
  echo "${COMMIT:-unknown}" > "$out/$part/commit.txt"
  cat "$out/$part/table.md"
  if [ "${PACK:-1}" = 1 ]; then tar czf "$out/$part.tgz" -C "$out" "$part" && rm -rf "${out:?}/$part"; fi
  return $status
}
start=$(date +%s)
for part in "$@"; do  # every name first: a typo costs no device time
  case "$part" in ddp|ddp_levels|fsdp2|zero|zero1|zero2|zero3|compiled) ;;
    *) echo "unknown part '$part' (ddp ddp_levels fsdp2 zero zero1 zero2 zero3 compiled)" >&2; exit 2 ;; esac
done
read -ra groups <<< "${GPU_GROUPS:-}"
for g in "${groups[@]}"; do
  [[ $g =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "GPU_GROUPS must be GPU lists separated by spaces (\"0,1 2,3\"), got" \
    "'$GPU_GROUPS'" >&2; exit 2; }
done
if [ "${#groups[@]}" -le 1 ]; then
  [ "${#groups[@]}" = 1 ] && export CUDA_VISIBLE_DEVICES=${groups[0]}
  overall=0
  for part in "$@"; do run_part "$part" || overall=1; done
  exit $overall
fi
mkdir -p "$out"
pids=()
for i in "${!groups[@]}"; do
  (
    export CUDA_VISIBLE_DEVICES=${groups[$i]} MAIN_PORT=$(( 29500 + 10 * (i + 1) ))
    overall=0; n=0
    for part in "$@"; do
      (( n++ % ${#groups[@]} == i )) || continue
      run_part "$part" || overall=1
    done
    exit $overall
  ) > "$out/gpus$i.log" 2>&1 &
  pids+=($!)
done
overall=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || overall=1
  echo "== GPUs ${groups[$i]}"; cat "$out/gpus$i.log"
done
exit $overall
