#!/usr/bin/env bash
# Which part of activation_dtype="fp8" costs its convergence (+12-14% held-out loss after 300 steps on the d4096
# proxy: results/gpu/2026-11-28-h200x2-convergence-d103418; found: the rotary angles a compiled graph saves,
# results/gpu/2026-11-28-h200-act8-bisect)? Nine 300-step msamp O2 trainings at once over the
# machine's GPUs (~8 minutes on two H200s, five runs on one of them: ~100 GB; losses and peaks are each run's own,
# speeds are not compared):
#
#   bash scripts/gpu/act8_bisect.sh OUT          # the set-up (.gpubundle wheels in /tmp/site) must have run
#
#   bf16            compiled BF16, the baseline
#   act8            compiled, activation_dtype="fp8" as it is (the graphs encode, the loss fused)
#   act8_torchloss  ... with the loss as torch ops (LOWPREC_FUSED_CROSS_ENTROPY=0)
#   act8_hooks      ... encoded by the Python hooks after each graph (LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=0)
#   act8_keep_fp32  ... inside the graphs, the FP32 tensors (residual stream) left as they are (act8_bisect.py
#                   --keep-traced-fp32: on two CPU cores this closed the gap, results/cpu/2026-11-28-act8-gap)
#   eager_act8      eager, activation_dtype="fp8"; then eager with what the named modules save left alone:
#   eager_attention, eager_mlp, eager_norm      (scripts/gpu/act8_bisect.py --keep)
#
# Writes OUT/act8-bisect/<name>.json + .log and summary.md (held-out loss against bf16's). Set COMMIT=<hash>;
# RUNS="bf16 act8 ..." runs those (default: the nine above; five fit one H200's memory); the later rounds' runs
# (below, results/gpu/2026-11-28-h200-act8-bisect) only when named.
set -uo pipefail
out=${1:?usage: bash scripts/gpu/act8_bisect.sh OUT}
cd "$(dirname "$0")/../.."
dir="$out/act8-bisect"
mkdir -p "$dir"
echo "${COMMIT:-unknown}" > "$dir/commit.txt"
export PYTHONUNBUFFERED=1
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l); [ "$gpus" -gt 0 ] || gpus=1
common="--size ${SIZE:-proxy} --steps ${STEPS:-300} --no-progress"
o2="--variant fp8 --backend msamp --recipe delayed --opt-level O2"
FIRST_ROUND="bf16 act8 act8_torchloss act8_hooks act8_keep_fp32 eager_act8 eager_attention eager_mlp eager_norm"
i=0
launch() {  # name, environment (VAR=value ... or -), then the script's arguments
  local name=$1 envs=$2; shift 2
  [ "$envs" = "-" ] && envs=""
  case " ${RUNS:-$FIRST_ROUND} " in *" $name "*) ;; *) return ;; esac
  env CUDA_VISIBLE_DEVICES=$((i % gpus)) $envs timeout "${RUN_TIMEOUT_S:-540}" python3 "$@" --json "$dir/$name.json" \
    > "$dir/$name.log" 2>&1 &
  i=$((i + 1))
}
launch bf16 - -m lowprec.demo.run --variant bf16 $common
launch act8 - -m lowprec.demo.run $o2 --activation-dtype fp8 $common
launch act8_torchloss LOWPREC_FUSED_CROSS_ENTROPY=0 -m lowprec.demo.run $o2 --activation-dtype fp8 $common
launch act8_hooks LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=0 -m lowprec.demo.run $o2 --activation-dtype fp8 $common
launch act8_keep_fp32 - scripts/gpu/act8_bisect.py --keep-traced-fp32 -- $o2 --activation-dtype fp8 $common
launch eager_act8 - scripts/gpu/act8_bisect.py -- $o2 --activation-dtype fp8 --no-compile $common
for kind in attention mlp norm; do
  launch "eager_$kind" - scripts/gpu/act8_bisect.py --keep $kind -- $o2 --activation-dtype fp8 --no-compile $common
done
# second round (after act8_keep_fp32 closed the gap on the GPU): does keeping FP32 tensors help the hooks and eager,
# and torchao; and what do the two compiled forms pack (one step of the small model, each decision printed)
launch act8_hooks_keep_fp32 LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=0 scripts/gpu/act8_bisect.py --keep-fp32 -- $o2 \
  --activation-dtype fp8 $common
launch eager_keep_fp32 - scripts/gpu/act8_bisect.py --keep-fp32 -- $o2 --activation-dtype fp8 --no-compile $common
launch torchao_act8_keep_fp32 - scripts/gpu/act8_bisect.py --keep-traced-fp32 -- --variant fp8 --backend torchao \
  --activation-dtype fp8 $common
# third round, the library's fix (activations_in_graph.is_angle; FP32 tensors with no history kept by the hooks)
launch torchao_act8 - -m lowprec.demo.run --variant fp8 --backend torchao --activation-dtype fp8 $common
launch torchao_o2_act8 - -m lowprec.demo.run --variant fp8 --backend torchao --opt-level O2 --activation-dtype fp8 \
  $common
launch trace_graph - scripts/gpu/act8_bisect.py --trace -- $o2 --activation-dtype fp8 --size ${TRACE_SIZE:-small} \
  --steps 1 --no-progress
launch trace_hooks LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=0 scripts/gpu/act8_bisect.py --trace -- $o2 --activation-dtype fp8 \
  --size ${TRACE_SIZE:-small} --steps 1 --no-progress
wait
FIRST_ROUND=$FIRST_ROUND python3 - "$dir" <<'PY' | tee "$dir/summary.md"
import json, os, sys
d = sys.argv[1]
runs = {f[:-5]: json.load(open(os.path.join(d, f))) for f in sorted(os.listdir(d))
        if f.endswith(".json") and not f.startswith("trace")}
base = runs.get("bf16", {}).get("heldout_loss")
print("| run | held-out loss | vs bf16 | peak GiB |\n|---|---|---|---|")
for name, r in runs.items():
    delta = f"{100 * (r['heldout_loss'] / base - 1):+.2f}%" if base else ""
    print(f"| {name} | {r['heldout_loss']:.4f} | {delta} | {r['peak_memory_bytes'] / 2**30:.2f} |")
wanted = (os.environ.get("RUNS") or os.environ["FIRST_ROUND"]).split()
missing = [n for n in wanted if n not in runs and not n.startswith("trace")]
if missing:
    print(f"\nno result (see their .log): {', '.join(missing)}")
PY
