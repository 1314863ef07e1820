source .carry/setup.sh
mkdir -p $OUT
export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
T0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py tests/gpu/test_fused.py -k "kept_launch or direct_launch or fused or rope or silu or rms or merged or hoisted or real_tp1" 2>&1 | grep -E "passed|failed|^E |FAILED" | head -30 | tee $OUT/tests.log
echo "tests $(( $(date +%s) - T0 )) s"
E2E="python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32"
timeout 100 $E2E --cuda-graphs --save $OUT/e2e-graphed.md > /dev/null 2>&1
timeout 100 $E2E --no-cuda-graphs --save $OUT/e2e-eager-a.md > /dev/null 2>&1
PYTHONPATH=$PWD/.carry/old timeout 100 $E2E --no-cuda-graphs --save $OUT/e2e-eager-old.md > /dev/null 2>&1
timeout 100 $E2E --no-cuda-graphs --save $OUT/e2e-eager-b.md > /dev/null 2>&1
for f in graphed eager-a eager-old eager-b; do echo "== $f"; grep "qwen3" $OUT/e2e-$f.md | cut -d'|' -f3,4,5,10,12,13; done
timeout 120 python3 .carry/hostprof.py bf16 bio > $OUT/hostprof.log 2>&1; grep -A14 "==" $OUT/hostprof.log | cut -c1-150
echo "total $(( $(date +%s) - T0 )) s"
