source .carry/setup.sh
mkdir -p $OUT
export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
for g in cuda-graphs no-cuda-graphs; do
timeout 100 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --$g --save $OUT/e2e-tp1-$g.md > /dev/null 2>&1
grep "qwen3" $OUT/e2e-tp1-$g.md | cut -d'|' -f3,4,5,10,12,13
done
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k "hoisted or real_tp1" 2>&1 | tail -2
