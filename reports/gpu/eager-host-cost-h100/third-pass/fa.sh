source .carry/setup.sh
mkdir -p $OUT
export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
T0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused.py 2>&1 | tail -15 > $OUT/gpu-tests-fused.log
cat $OUT/gpu-tests-fused.log; echo "fused tests $(( $(date +%s) - T0 )) s"
for g in cuda-graphs no-cuda-graphs; do
timeout 200 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --$g --save $OUT/e2e-tp1-$g.md 2>&1 | tail -2
grep "qwen3" $OUT/e2e-tp1-$g.md | cut -d'|' -f3,4,5,10,12
done
echo "total $(( $(date +%s) - T0 )) s"
