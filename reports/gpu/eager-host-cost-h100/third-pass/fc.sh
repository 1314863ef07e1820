source .carry/setup.sh
mkdir -p $OUT
export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
T0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused.py 2>&1 | tail -15 > $OUT/gpu-tests-fused.log
tail -4 $OUT/gpu-tests-fused.log; grep -E "^E .*assert|FAILED" $OUT/gpu-tests-fused.log | head -5; echo "fused tests $(( $(date +%s) - T0 )) s"
for g in cuda-graphs no-cuda-graphs; do
timeout 150 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --$g --save $OUT/e2e-tp1-$g.md > /dev/null 2>&1
grep "qwen3" $OUT/e2e-tp1-$g.md | cut -d'|' -f3,4,5,10,12
done
echo "bench $(( $(date +%s) - T0 )) s"
timeout 120 python3 .carry/hostprof.py bf16 bio 2>&1 | tail -50 > $OUT/hostprof.log
head -30 $OUT/hostprof.log | cut -c1-150
echo "total $(( $(date +%s) - T0 )) s"
