#!/usr/bin/env bash
# The published GPU benchmarks in one go: seed-moe rollout (compiled, CUDA graph), kernels, the
# MoE matrix, then verify; JSON (+ plots when matplotlib is there) into $OUT, tables on stdout, and
# a markdown page rendered from the JSON ($OUT/BENCHMARKS.md).
#
# From the repository root, on the device machine (packages not installed, so PYTHONPATH):
#   bash benchmarks/gpu/publish.sh
# Without $OUT it writes benchmarks/results/<machine>-<date>/. About 6-8 minutes on one H200,
# most of it torch.compile. Set SKIP_VERIFY=1 to leave out the correctness pass.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if [ -z "${OUT:-}" ]; then
  OUT="$($PY -c 'from moe_tools.report import results_folder; print(results_folder())')"
fi
mkdir -p "$OUT"

plot_args() {  # --plot only when matplotlib imports (the `plot` extra)
  if $PY -c "import matplotlib" 2>/dev/null; then
    echo "--plot $OUT/$1"
  else
    echo "# matplotlib missing: no $1" >&2
  fi
}

status=0
run() {
  echo
  echo "### moe-bench $*"
  local t0=$SECONDS
  $PY -m moe_tools.cli "$@" || { echo "### exit status $? for: $*"; status=1; }
  echo "### $((SECONDS - t0)) s"
}

# shellcheck disable=SC2046
run rollout --preset seed-moe --frames 256 --compile --cuda-graph --json "$OUT/rollout.json" \
  $(plot_args rollout.png)
# shellcheck disable=SC2046
run kernels --json "$OUT/kernels.json" $(plot_args kernels.png)
run matrix --preset seed-moe --json "$OUT/matrix.json"
if [ -z "${SKIP_VERIFY:-}" ]; then
  run verify --json "$OUT/verify.json"
fi
$PY -m moe_tools.cli report --results "$OUT" --out "$OUT/BENCHMARKS.md" --title "moe-bench results"
ls -l "$OUT"
exit $status
