#!/usr/bin/env bash
# Set up a virtual environment (first run only) and run the demo or the tests.
#
#   bash scripts/run.sh demo [lowprec demo options]   # BF16 vs FP8 training through Accelerate
#   bash scripts/run.sh test [pytest options]         # the CPU test suite (what CI runs)
#
# torch is installed first and pinned, so installing lowprec's other requirements never replaces it.
# Which build `torch==2.13.0` is depends on the index: on a stock Linux machine PyPI's is the CUDA
# build with its NVIDIA packages (several GB); LOWPREC_TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes the CPU build instead. On a machine that already has a CUDA torch (a GPU host), set
# LOWPREC_USE_SYSTEM_TORCH=1 to keep it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LOWPREC_VENV:-.venv}
py=${PYTHON:-python3}
torch_version=${LOWPREC_TORCH_VERSION:-2.13.0}

if [ ! -x "$venv/bin/python" ]; then
  echo "lowprec: creating $venv" >&2
  if [ "${LOWPREC_USE_SYSTEM_TORCH:-0}" = 1 ]; then
    "$py" -m venv --system-site-packages "$venv"
  else
    "$py" -m venv "$venv"
  fi
fi
pip() { "$venv/bin/python" -m pip -q --disable-pip-version-check "$@"; }
stamp="$venv/.lowprec-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if [ "${LOWPREC_USE_SYSTEM_TORCH:-0}" != 1 ]; then
    pip install "torch==$torch_version" ${LOWPREC_TORCH_INDEX:+--index-url "$LOWPREC_TORCH_INDEX"}
  fi
  pip install -e ".[torchao,test]"
  touch "$stamp"
fi
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=${TORCHAO_FORCE_SKIP_LOADING_SO_FILES:-$("$venv/bin/python" -c 'import torch; print(0 if torch.cuda.is_available() else 1)')}

cmd=${1:-}
shift || true
case "$cmd" in
  demo) exec "$venv/bin/lowprec" demo "$@" ;;
  test) exec "$venv/bin/python" -m pytest -q "$@" ;;
  *) echo "usage: bash scripts/run.sh demo|test [options]" >&2; exit 2 ;;
esac
