#!/usr/bin/env bash
# The published GPU results in one go: every command line of PUBLISHED below, each saved as
# current data (`--save`: $OUT/<machine>/<name>.json, replacing that command's last run), then
# BENCHMARKS.md rendered from $OUT. Tables and logs go to stdout and to $CACHE (ignored by git),
# plots too when matplotlib is there: pictures and logs stay out of the repository.
#
# From the repository root, on the device machine (packages not installed, so PYTHONPATH):
#   bash benchmarks/gpu/publish.sh                    # everything (the routing sweep: minutes)
#   ONLY=kernels,verify bash benchmarks/gpu/publish.sh   # lines whose command is listed
# OUT defaults to benchmarks/results; BENCHMARKS=<path> or BENCHMARKS= (none) for the page.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
OUT="${OUT:-benchmarks/results}"
CACHE="${CACHE:-benchmarks/.cache/publish-$(date -u +%Y-%m-%dT%H%M)}"
BENCHMARKS="${BENCHMARKS-BENCHMARKS.md}"
mkdir -p "$CACHE"

# One published command line each (moe-bench's arguments). A new row of BENCHMARKS.md is a new
# line here: its run writes a new data file.
PUBLISHED=(
  "matrix --preset seed-moe"
  "matrix --preset seed-moe --impls torch,triton_bf16"
  "matrix --preset deepseek-v3 --tokens 4096 --impls torch,triton_bf16"
  "matrix --preset deepseek-v3 --tokens 64 --impls torch,triton_bf16"
  "matrix --preset qwen3-30b-a3b --tokens 4096 --impls torch,triton_bf16"
  "matrix --preset qwen3-30b-a3b --tokens 64 --impls torch,triton_bf16"
  "rollout --preset seed-moe --frames 256 --compile --cuda-graph"
  "rollout --preset seed-moe --modes compile,graph --frames 256"
  "rollout --preset seed-moe --modes eager,compile,graph --no-images --frames 128 --profile"
  "kernels"
  "kernels --ops route,index_shuffling"
  "kernels --ops silu_mul,silu_mul_quant,gather_scale_quant_dense_tokens,combine_shuffling,split_shuffling,scatter_add_padded_tokens"
  "kernels --ops to_blocked_per_group_2d,to_blocked_per_group_3d"
  "kernels --sweep routing --jobs 16"
  "kernels --sweep routing --jobs 16 --sweep-T 4096,65536,1048576 --sweep-E 16,32,128,320 --sweep-k 1,8"
  "verify"
  "train --preset seed-moe"
  "train --preset seed-moe --impls torch,triton_bf16 --steps 0"
  "train --tokens 8192 --experts 128 --hidden 768 --gated --impls torch,triton_bf16 --steps 0"
  "train --tokens 32768 --d-model 4096 --experts 128 --hidden 1024 --gated --impls torch,triton_bf16 --steps 0"
  "train --tokens 24576 --d-model 1536 --experts 128 --hidden 256 --gated --impls torch,triton_bf16 --steps 0"
  "train --sweep --gated --no-compile --sweep-axes tokens,hidden"
  "train --sweep --gated --no-compile --sweep-axes n_experts,top_k"
)

has_plot() { [[ " $1 " =~ \ (rollout|kernels|train)\  ]]; }
wanted() { [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",${1%% *},"* ]]; }

status=0
i=0
for line in "${PUBLISHED[@]}"; do
  i=$((i + 1))
  wanted "$line" || continue
  # shellcheck disable=SC2206
  args=($line)
  extra=()
  if has_plot "$line" && $PY -c "import matplotlib" 2>/dev/null; then
    extra=(--plot "$CACHE/$i-${args[0]}.png")
  fi
  echo
  echo "### moe-bench $line"
  t0=$SECONDS
  $PY -m moe_tools.cli "${args[@]}" --no-progress --save "$OUT" "${extra[@]}" 2>&1 \
    | tee "$CACHE/$i-${args[0]}.log" || true
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "### exit status $rc for: $line"; status=1; }
  echo "### $((SECONDS - t0)) s"
done
if [ -n "$BENCHMARKS" ]; then
  $PY -m moe_tools.cli report --results "$OUT" --out "$BENCHMARKS" --force \
    --title "moe-bench results" || status=1
fi
echo "logs and plots: $CACHE"
exit $status
