source .carry/setup.sh
export DETAUDIT_WHEEL_DIR=/tmp/smolwheel HF_HUB_OFFLINE=1
mkdir -p $OUT
for g in cuda-graphs no-cuda-graphs; do
python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1,2 --batch-sizes 8,32 --new-tokens 32 --$g --save $OUT/e2e-tp12-$g.md 2>&1 | tail -3
cat $OUT/e2e-tp12-$g.md
done
