#!/usr/bin/env bash
# The one command every GPU-touching change ends with: on the GPU host, in one device call (under 10
# minutes with the set-up), the whole GPU suite and the headline comparison on the current tree.
#
#   bash scripts/gpu/verify.sh OUT [COMMIT]
#
# Writes OUT/<date>-<gpu>-verify/: commit.txt (the tree measured: COMMIT, or `git rev-parse HEAD` where
# the tree is a checkout; the device's copy of the working tree has no .git), env.txt (packages),
# pytest_msamp.txt + pytest_rest.txt + pytest_te.txt (the suite in six parts, the two-GPU one and torchao's appended to
# pytest_rest.txt; TE's two once its extension is compiled, the one through Accelerate's engines appended to
# pytest_te.txt; -rfEsxXp: a line per test, failures' output, but not every
# passing test's captured log, which made these files 0.4-0.7 MB each and the device's 64 MiB carry overflow),
# headline.json + headline.md + headline.log (benchmarks/headline.py). Commit that folder under results/gpu/. The set-up (.gpubundle, see ../shared/gpu/make_bundle.sh) runs once per machine.
# HEADLINE_ARGS replaces the headline's default arguments (d4096, every default configuration); HEADLINE_ADD
# ("msamp O2 own rows,msamp O2 act8") runs those configurations after the default ones; HEADLINE_CONFIGS ("bf16
# compiled,msamp O2") runs those instead of the default ones;
# PYTEST_ARGS adds pytest options (-k, -x, ...). VERIFY_BUDGET_S (default 570) bounds the whole script,
# set-up included, so that it ends inside one device call: the headline gets what the suite leaves and
# keeps every configuration that finished (its JSON is rewritten after each one). The suite needs about 420 s of it
# on a fresh machine: TE's parts start once TE's extension is built (~150 s) and take ~280 s after it, the others
# run beside them; at VERIFY_BUDGET_S=465 TE's parts were cut (results/gpu/2026-11-29-h200-verify-84cfb3a, 0 failed
# but 16 of TE's 34 tests not reached): below the default 570 TE is cut. PACK=1 packs the folder into
# <folder>.tgz at the end, for a call that also brings back files of its own (the device tool brings back 8 a call).
set -uo pipefail
start=$(date +%s)
out=${1:?usage: bash scripts/gpu/verify.sh OUT [COMMIT]}
commit=${2:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
cd "$(dirname "$0")/../.."
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE 'H100|H200|B200|A100|L40S' || echo gpu)
dir="$out/$(date -u +%Y-%m-%d)-${gpu,,}-verify"
mkdir -p "$dir"
if [ $(( ${VERIFY_BUDGET_S:-570} - ${HEADLINE_RESERVE_S:-150} )) -lt 420 ]; then
  echo "verify.sh: warning: VERIFY_BUDGET_S - HEADLINE_RESERVE_S leaves the suite under the ~420 s it needs on a" \
       "fresh machine: TE's parts, which start after TE's build, will be cut" >&2
fi
setup_pid=""
if [ ! -f /tmp/site/.lowprec-setup-done ]; then
  # setup.sh installs the wheels, then compiles TE's torch extension in /tmp/tebuild (~2.5 minutes on all
  # cores): the suite's torchao and msamp parts need only the wheels, so they start while TE compiles.
  rm -rf /tmp/tebuild
  (bash .gpubundle/setup.sh > /tmp/setup.log 2>&1 && touch /tmp/site/.lowprec-setup-done) &
  setup_pid=$!
  while [ ! -d /tmp/tebuild ] && kill -0 "$setup_pid" 2>/dev/null; do sleep 2; done
fi
export PYTHONPATH=/tmp/site:$PWD NVTE_FRAMEWORK=pytorch PYTHONUNBUFFERED=1
echo "$commit" > "$dir/commit.txt"
t0=$(date +%s)
suite() {  # suite NAME TESTS...: one part of the GPU suite, bounded so that the headline keeps its reserve
  local name=$1; shift
  # -v names each test as it starts; faulthandler dumps every thread's stack of a test past 150 s
  # shellcheck disable=SC2086
  timeout $(( ${VERIFY_BUDGET_S:-570} - ${HEADLINE_RESERVE_S:-150} - ($(date +%s) - start) )) \
    python3 -m pytest -m gpu "$@" -v -rfEsxXp -p no:cacheprovider --durations=10 -o faulthandler_timeout=150 \
    ${PYTEST_ARGS:-} > "$dir/pytest_$name.txt" 2>&1
  local code=$?
  grep -E "^(=+ )?[0-9]+ (passed|failed)" "$dir/pytest_$name.txt" | tail -1
  echo "pytest ($name) exit $code" | tee -a "$dir/pytest_$name.txt"
  return $code
}
# The suite's parts run side by side on the GPU (correctness tests: nothing in them is timed): msamp's file
# and the rest from the start, TE's once its extension is built; the headline runs alone after them. As one part,
# msamp's and the rest took 322 s at 85a7575 and ran past 415 s at 7ec8725 while TE compiled on every core.
# Every GPU test file but TE's, msamp's, torchao's and the two-GPU one goes in the rest, so a new file is never left
# out of the suite. The two-GPU file (torchrun over both cards, ~110 s of process starts) runs as a fourth part beside the
# others since bebfea9, where the rest with it ran past its budget at 69 of 71 tests; its output is appended to
# pytest_rest.txt, so the folder keeps its 8 files.
suite msamp tests/gpu/test_msamp_gpu.py > "$dir/.suite1" 2>&1 &
msamp_pid=$!
# shellcheck disable=SC2046
suite rest $(ls tests/gpu/test_*_gpu.py | grep -v -e '/test_te_gpu.py$' -e '/test_msamp_gpu.py$' \
  -e '/test_grad_overlap_gpu.py$' -e '/test_torchao_gpu.py$') > "$dir/.suite2" 2>&1 &
rest_pid=$!
# torchao's file as a part of its own since 94c2778: with its FSDP2 tests the rest would pass the suite's budget
# (373 s of its 420 at 9be81f4 without them); its output is appended to pytest_rest.txt, as the two-GPU part's
suite torchao tests/gpu/test_torchao_gpu.py > "$dir/.suite4" 2>&1 &
torchao_pid=$!
suite multi tests/gpu/test_grad_overlap_gpu.py > "$dir/.suite3" 2>&1 &
multi_pid=$!
if [ -n "$setup_pid" ]; then
  wait "$setup_pid" || { echo "setup failed:"; tail -20 /tmp/setup.log; exit 1; }
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 - <<'PY'
import importlib
for m in ["torch", "accelerate", "transformers", "torchao", "deepspeed", "transformer_engine", "triton"]:
    try:
        print(f"{m} {importlib.import_module(m).__version__}")
    except Exception as e:  # noqa: BLE001
        print(f"{m} unavailable: {type(e).__name__}: {str(e)[:200]}")
PY
} > "$dir/env.txt" 2>&1
# TE's file in two parts side by side since 4a73b59, where as one part it ran past its budget at test 31 of 34: the
# tests through Accelerate's engines (a process each, ~90 s together) beside the others; appended to pytest_te.txt
suite te_engines tests/gpu/test_te_gpu.py -k through_accelerate > "$dir/.suite5" 2>&1 &
te_engines_pid=$!
suite te tests/gpu/test_te_gpu.py -k "not through_accelerate"; rc=$?
wait "$te_engines_pid"; rc_te_engines=$?
{ echo; echo "==== TE's tests through Accelerate's engines, run beside the rest of the file"; cat "$dir/pytest_te_engines.txt"; } \
  >> "$dir/pytest_te.txt" && rm -f "$dir/pytest_te_engines.txt"
wait "$msamp_pid"; rc_msamp=$?
wait "$rest_pid"; rc_rest=$?
wait "$multi_pid"; rc_multi=$?
wait "$torchao_pid"; rc_torchao=$?
{ echo; echo "==== the two-GPU part (tests/gpu/test_grad_overlap_gpu.py), run beside the rest"; cat "$dir/pytest_multi.txt"; } \
  >> "$dir/pytest_rest.txt" && rm -f "$dir/pytest_multi.txt"
{ echo; echo "==== torchao's part (tests/gpu/test_torchao_gpu.py), run beside the rest"; cat "$dir/pytest_torchao.txt"; } \
  >> "$dir/pytest_rest.txt" && rm -f "$dir/pytest_torchao.txt"
cat "$dir/.suite1" "$dir/.suite2" "$dir/.suite3" "$dir/.suite4" "$dir/.suite5"
rm -f "$dir/.suite1" "$dir/.suite2" "$dir/.suite3" "$dir/.suite4" "$dir/.suite5"
[ "$rc" = 0 ] && rc=$rc_te_engines
[ "$rc" = 0 ] && rc=$rc_msamp
[ "$rc" = 0 ] && rc=$rc_rest
[ "$rc" = 0 ] && rc=$rc_multi
[ "$rc" = 0 ] && rc=$rc_torchao
echo "GPU suite: exit $rc in $(( $(date +%s) - t0 )) s"
left=$(( ${VERIFY_BUDGET_S:-570} - ($(date +%s) - start) ))
echo "headline: $left s left"
# HEADLINE_ADD="name,name": configurations (benchmarks/headline.py's names, which hold spaces) after the defaults
extra=()
if [ -n "${HEADLINE_CONFIGS:-}" ]; then  # "name,name": these configurations instead of the defaults
  IFS=, read -r -a chosen <<< "$HEADLINE_CONFIGS"
  extra=(--configs "${chosen[@]}")
elif [ -n "${HEADLINE_ADD:-}" ]; then
  mapfile -t defaults < <(python3 -c 'import ast
body = ast.parse(open("benchmarks/headline.py").read()).body
print("\n".join(next(ast.literal_eval(n.value) for n in body if isinstance(n, ast.Assign)
                     and getattr(n.targets[0], "id", "") == "DEFAULT_CONFIGS")))')
  IFS=, read -r -a added <<< "$HEADLINE_ADD"
  extra=(--configs "${defaults[@]}" "${added[@]}")
fi
# shellcheck disable=SC2086
LOWPREC_COMMIT=$commit timeout "$left" python3 benchmarks/headline.py ${HEADLINE_ARGS:---widths d4096} ${extra[@]+"${extra[@]}"} --out "$dir/headline.json" \
  > "$dir/headline.log" 2>&1 || echo "headline exit $? (124: cut off by the budget)" | tee -a "$dir/headline.log"
python3 benchmarks/headline.py --summarize "$dir/headline.json" | tee "$dir/headline.md"
if [ -n "${PACK:-}" ]; then  # one file: the device tool brings back at most 8 files a call (the folder has 8)
  tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")" && rm -rf "$dir"
fi
exit $rc
