#!/usr/bin/env bash
# Issue 32's measurements on one GPU (saved activations in FP8), each part sized for one device call:
#
#   bash scripts/gpu/memory.sh OUT headline      # ~6 min: d4096 proxy, compiled BF16, torchao and
#                                                #   msamp O2 with and without activation_dtype='fp8': speed,
#                                                #   peak (and in which phase), the memory a forward holds for
#                                                #   backward; FP8 activations inside the compiled graphs
#                                                #   (act8) and through Python hooks (act8 hooks); kernels.tgz: msamp O2's
#                                                #   kernel tables and what is live at the peak (.peak.txt)
#   bash scripts/gpu/memory.sh OUT headline_te   # ~4 min: eager BF16, te, te with activation_dtype='fp8' (and O1,
#                                                #   O2); te_peaks.tgz: te O2's kernel table, te O1's peak
#   bash scripts/gpu/memory.sh OUT loss          # ~4 min: the loss fused and as torch ops, torchao O2 act8
#   bash scripts/gpu/memory.sh OUT states        # ~5 min: te and torchao with FP8 activations, Adam's moments in
#                                                #   FP32 and in BF16 (optimizer_states='bf16'), two rounds
#                                                #   (ABBA), against eager and compiled BF16 (TE's extension)
#   bash scripts/gpu/memory.sh OUT realize       # ~5 min: msamp O2 and torchao O2 with FP8 activations with
#                                                #   inductor's realize_opcount_threshold at 64 and at its default,
#                                                #   msamp's amaxes over own rows, one round (at 2a04d10 a second
#                                                #   round's peaks rose 2-12 GiB, unexplained);
#                                                #   realize.peak.tgz: the msamp peaks, with the code they name
#   bash scripts/gpu/memory.sh OUT recompute     # ~6 min: the FP8 Linears' transposed inputs recomputed in backward
#                                                #   (LOWPREC_RECOMPUTE_FP8_COPIES=1) for msamp O2 act8 (and with
#                                                #   own-row amaxes), torchao act8 and O2 act8, one round, against
#                                                #   compiled BF16 and the same without; recompute.peak.tgz: peaks
#   bash scripts/gpu/memory.sh OUT combined      # ~6 min: msamp O2 act8 with the recompute and inductor's
#                                                #   realize_opcount_threshold at 64, with and without own-row
#                                                #   amaxes, one round; combined.peak.tgz: their peaks
#   bash scripts/gpu/memory.sh OUT ownrows       # ~6 min: msamp O2 (no FP8 activations) with its amaxes over
#                                                #   fixed-length rows (the default) and over own rows, two rounds
#   bash scripts/gpu/memory.sh OUT whole         # ~6 min: the model compiled as one graph (head and loss too):
#                                                #   BF16, torchao and msamp O2 with and without FP8 activations;
#                                                #   (and block by block, for the peak report);
#                                                #   whole.peak.tgz: what is live at the peak
#   bash scripts/gpu/memory.sh OUT convergence   # ~7 min: lowprec bench --convergence (300 steps, proxy):
#                                                #   held-out loss of each FP8-activation configuration vs BF16
#                                                #   (CONVERGENCE_CONFIGS: others, e.g. "bf16
#                                                #   torchao:tensorwise:O2,activation_dtype=fp8", ~4.5 min each;
#                                                #   CONVERGENCE_JOBS=5: five at a time over the machine's GPUs,
#                                                #   losses and peaks each run's own, speeds not compared;
#                                                #   CONVERGENCE_SEEDS=3: each configuration with seeds 0..2,
#                                                #   against BF16's run of the same seed and BF16's mean;
#                                                #   CONVERGENCE_COMPILE=false: every run eager, BF16 too,
#                                                #   as te's DelayedScaling needs)
#   bash scripts/gpu/memory.sh OUT inbackward    # ~5 min: torchao (compiled) and te (eager) with FP8 activations,
#                                                #   with and without optimizer_in_backward (each parameter
#                                                #   stepped in backward, its FP32 gradient freed there), against
#                                                #   BF16 of the same mode: speed, peak and its phase (te: TE's
#                                                #   extension)
#   bash scripts/gpu/memory.sh OUT largest       # ~8 min: benchmarks/largest_model.py, the deepest proxy each
#                                                #   configuration trains at batch 4 x 2048 (LARGEST_CONFIGS:
#                                                #   others, ';'-separated, e.g. "bf16 compiled;torchao O2 act8";
#                                                #   LARGEST_CAPACITY_GIB=78.5: an 80 GB H100's memory, each run's
#                                                #   allocator capped at it, on a larger GPU)
#
# Several parts may be named in one call, within the device's 8 files a call: headline and whole together write
# 9 with commit.txt (run whole in a call of its own, or with headline_te). The set-up (.gpubundle/setup.sh, see verify.sh) must have run on
# the machine; TE's configurations need its compiled extension (they fail alone without it). Writes
# OUT/<date>-<gpu>-memory/: one file per part plus commit.txt; commit that folder under results/gpu/. Set COMMIT=<hash>
# (the tree's commit) on the device: its copy of the tree may carry a stale .git.
set -uo pipefail
out=${1:?usage: bash scripts/gpu/memory.sh OUT headline|headline_te|loss|states|realize|recompute|combined|whole|convergence|inbackward|largest ...}; shift
[ $# -gt 0 ] || { echo "name at least one part: headline headline_te loss states realize recompute combined whole convergence inbackward largest" >&2
                  exit 2; }
cd "$(dirname "$0")/../.."
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE 'H100|H200|B200' || echo gpu)
dir="$out/$(date -u +%Y-%m-%d)-${gpu,,}-memory"
mkdir -p "$dir"
export PYTHONUNBUFFERED=1
# COMMIT first: the device copy of the tree may carry a stale .git
if [ -n "${COMMIT:-}" ]; then echo "$COMMIT" > "$dir/commit.txt"; export LOWPREC_COMMIT=$COMMIT  # headline.py's JSON
else
  echo "memory.sh: COMMIT is not set: commit.txt says what git rev-parse says, which may be a stale .git's" >&2
  git rev-parse HEAD > "$dir/commit.txt" 2>/dev/null || echo unknown > "$dir/commit.txt"
fi
status=0
# largest: headline configuration names (LARGEST_CONFIGS, a ';'-separated list, chooses others: each takes ~1.5 min)
IFS=';' read -ra LARGEST_CONFIGS <<< "${LARGEST_CONFIGS:-bf16 compiled;torchao;torchao act8;msamp O2;msamp O2 act8}"
for part in "$@"; do
  echo "== $part"
  case "$part" in
    headline)
      # compiled: BF16, torchao and msamp O2 with FP8 activations inside the graphs and through Python hooks
      python3 benchmarks/headline.py --widths d4096 --out "$dir/headline.json" --configs \
        "bf16 compiled" torchao "torchao act8" "torchao act8 hooks" "msamp O2" "msamp O2 act8" "msamp O2 act8 hooks" \
        --profile-dir "$dir/kernels" --profile-configs "msamp O2" "msamp O2 act8" \
        --peak-configs "bf16 compiled" "msamp O2" "msamp O2 act8" \
        > "$dir/headline.log" 2>&1 || status=1
      python3 benchmarks/headline.py --summarize "$dir/headline.json" > "$dir/headline.md" 2>&1
      # one file for the kernel tables and peak reports: the device tool brings back at most 8 files a call
      tar czf "$dir/kernels.tgz" -C "$dir" kernels && rm -rf "$dir/kernels" ;;
    loss)
      # the loss of activation_dtype='fp8' fused (the default on CUDA) and as torch ops (LOWPREC_FUSED_CROSS_ENTROPY=0),
      # and torchao with MS-AMP's O2 storage besides (its peak is its FP32 model state): kernel table and peak
      python3 benchmarks/headline.py --widths d4096 --out "$dir/loss.json" --configs "bf16 compiled" \
        "msamp O2 act8" "msamp O2 act8 torch loss" "torchao act8" "torchao O2 act8" \
        --profile-dir "$dir/loss_peaks" --profile-configs "torchao O2 act8" --peak-configs "msamp O2 act8" \
        "torchao O2 act8" > "$dir/loss.log" 2>&1 || status=1
      python3 benchmarks/headline.py --summarize "$dir/loss.json" > "$dir/loss.md" 2>&1
      tar czf "$dir/loss.peak.tgz" -C "$dir" loss_peaks && rm -rf "$dir/loss_peaks" ;;
    states)
      # te's and torchao's peaks with FP8 activations are their FP32 model state at the optimizer step: BF16 moments
      python3 benchmarks/headline.py --widths d4096 --out "$dir/states.json" --rounds 2 --configs "bf16 eager" \
        "te act8" "te act8 bf16m" "bf16 compiled" "torchao act8" "torchao act8 bf16m" \
        > "$dir/states.log" 2>&1 || status=1
      python3 benchmarks/headline.py --summarize "$dir/states.json" > "$dir/states.md" 2>&1 ;;
    realize)
      # an FP32 block of SiLU's backward at msamp O2 act8's peak, stored by inductor's op-count rule (results/gpu/
      # 2026-11-28-h200-act8-peak-05e9f2d; the decode's clamp, gone since 96eb278, pushed it over): the same
      # configurations with the rule relaxed, in one process: what else the rule still stores
      # and msamp's amaxes over each matrix's own rows (kernels.scaling.AMAX_OVER_OWN_ROWS), which inductor may fuse
      # with the kernel that computes the gradient whose BF16 copy it stored for the amax alone (2a04d10)
      python3 benchmarks/headline.py --widths d4096 --out "$dir/realize.json" --configs "bf16 compiled" \
        "msamp O2 act8" "msamp O2 act8 realize64" "msamp O2 act8 own rows" "msamp O2 act8 own rows realize64" \
        "torchao O2 act8" "torchao O2 act8 realize64" \
        --profile-dir "$dir/realize_peaks" --profile-configs --peak-configs "msamp O2 act8" "msamp O2 act8 realize64" \
        "msamp O2 act8 own rows" "msamp O2 act8 own rows realize64" \
        > "$dir/realize.log" 2>&1 || status=1
      python3 benchmarks/headline.py --summarize "$dir/realize.json" > "$dir/realize.md" 2>&1
      tar czf "$dir/realize.peak.tgz" -C "$dir" realize_peaks && rm -rf "$dir/realize_peaks" ;;
    recompute)
      # the FP8 copies a compiled block keeps only for its backward, cast again there (runtime/fp8_copies_recompute):
      # 0.81 GiB of msamp O2 act8's steady 10.77 GiB (results/gpu/2026-11-28-h200x2-realize-teloss-0e7acfb)
      python3 benchmarks/headline.py --widths d4096 --out "$dir/recompute.json" --configs "bf16 compiled" \
        "msamp O2 act8 own rows" "msamp O2 act8 own rows recompute" "msamp O2 act8" "msamp O2 act8 recompute" \
        "torchao act8" "torchao act8 recompute" "torchao O2 act8 recompute" \
        --profile-dir "$dir/recompute_peaks" --profile-configs --peak-configs "msamp O2 act8 own rows recompute" \
        "msamp O2 act8 recompute" \
        > "$dir/recompute.log" 2>&1 || status=1
      python3 benchmarks/headline.py --summarize "$dir/recompute.json" > "$dir/recompute.md" 2>&1
      tar czf "$dir/recompute.peak.tgz" -C "$dir" recompute_peaks && rm -rf "$dir/recompute_peaks" ;;
    combined)
      # with the recompute, SiLU's backward half came back as an FP32 block at the steady peak (0.44 GiB, past
      # inductor's op-count rule: results/gpu/2026-11-28-h200x2-recompute-aabeb3e): the recompute with the rule at 64,
      # with and without the own-row amaxes, one round (a second one's peaks rose at 2a04d10) against compiled BF16
      python3 benchmarks/headline.py --widths d4096 --out "$dir/combined.json" --configs "bf16 compiled" \
        "msamp O2 act8 own rows recompute" "msamp O2 act8 own rows recompute realize64" \
        "msamp O2 act8 recompute realize64" \
        --profile-dir "$dir/combined_peaks" --profile-configs --peak-configs \
        "msamp O2 act8 own rows recompute realize64" "msamp O2 act8 recompute realize64" \
        > "$dir/combined.log" 2>&1 || status=1
      python3 benchmarks/headline.py --summarize "$dir/combined.json" > "$dir/combined.md" 2>&1
      tar czf "$dir/combined.peak.tgz" -C "$dir" combined_peaks && rm -rf "$dir/combined_peaks" ;;
    headline_te)
      # eager: BF16 and te with and without FP8 activations (TE's compiled extension needed); te O2's kernel table
      # (its step is ~4 ms longer than te act8's) and what is live at te O1's peak
      python3 benchmarks/headline.py --widths d4096 --out "$dir/headline_te.json" \
        --configs "bf16 eager" te "te act8" "te O1 act8" "te O2 act8" \
        --profile-dir "$dir/te_peaks" --profile-configs "te O2 act8" --peak-configs "te O1 act8" \
        > "$dir/headline_te.log" 2>&1 || status=1
      python3 benchmarks/headline.py --summarize "$dir/headline_te.json" > "$dir/headline_te.md" 2>&1
      tar czf "$dir/te_peaks.tgz" -C "$dir" te_peaks && rm -rf "$dir/te_peaks" ;;
    ownrows)
      # msamp's amaxes over each matrix's own rows (kernels.scaling.AMAX_OVER_OWN_ROWS, off by default): with FP8
      # activations as fast and 0.02x BF16's peak lower at 0e7acfb, aabeb3e and 6365b0b; not yet run without them,
      # the default's configuration: with and without, two rounds (ABAB), before it may become the default
      python3 benchmarks/headline.py --widths d4096 --rounds 2 --out "$dir/ownrows.json" --configs "bf16 compiled" \
        "msamp O2" "msamp O2 own rows" \
        > "$dir/ownrows.log" 2>&1 || status=1
      python3 benchmarks/headline.py --summarize "$dir/ownrows.json" > "$dir/ownrows.md" 2>&1 ;;
    whole)
      # the loss's FP32 log-softmax, which regional compilation leaves to eager, fused by inductor
      python3 benchmarks/headline.py --widths d4096 --out "$dir/whole.json" --configs "bf16 whole" \
        "msamp O2 act8 whole" "msamp O2 whole" "torchao act8 whole" "torchao whole" "msamp O2 act8" \
        --profile-dir "$dir/whole_peaks" --profile-configs --peak-configs "bf16 whole" "msamp O2 act8 whole" \
        "msamp O2 act8" \
        > "$dir/whole.log" 2>&1 || status=1
      python3 benchmarks/headline.py --summarize "$dir/whole.json" > "$dir/whole.md" 2>&1
      tar czf "$dir/whole.peak.tgz" -C "$dir" whole_peaks && rm -rf "$dir/whole_peaks" ;;
    convergence)
      case "${CONVERGENCE_COMPILE:-true}" in
        true) mode=--compile ;; false) mode=--no-compile ;;
        *) echo "CONVERGENCE_COMPILE must be true or false, got '$CONVERGENCE_COMPILE'" >&2; exit 2 ;;
      esac
      python3 -m lowprec.cli bench --convergence "$mode" --steps 300 --size proxy --no-raw --no-progress \
        --out "$dir/convergence" \
        --jobs "${CONVERGENCE_JOBS:-1}" --seeds "${CONVERGENCE_SEEDS:-1}" \
        --configs ${CONVERGENCE_CONFIGS:-bf16 msamp:delayed:O2 msamp:delayed:O2,activation_dtype=fp8 \
        torchao:tensorwise,activation_dtype=fp8} \
        > "$dir/convergence.log" 2>&1 || status=1 ;;
    inbackward)
      python3 benchmarks/headline.py --widths d4096 --out "$dir/inbackward.json" --configs "bf16 compiled" \
        "torchao act8" "torchao act8 in backward" "bf16 eager" "te act8" "te act8 in backward" \
        > "$dir/inbackward.log" 2>&1 || status=1 ;;
    largest)
      python3 benchmarks/largest_model.py --width d4096 --out "$dir/largest.json" \
        ${LARGEST_CAPACITY_GIB:+--capacity-gib "$LARGEST_CAPACITY_GIB"} \
        --configs "${LARGEST_CONFIGS[@]}" > "$dir/largest.log" 2>&1 || status=1 ;;
    *) echo "unknown part '$part' (headline|headline_te|loss|states|realize|recompute|combined|ownrows|whole|convergence|inbackward|largest)" >&2
       exit 2 ;;
  esac
  tail -15 "$dir/$part.log" 2>/dev/null
done
exit $status
