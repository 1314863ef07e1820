# issue 22, fourth pass, last call (one H100): e2e eager vs graphed with the decode loop's objects frozen
source .carry/setup.sh
mkdir -p $OUT
export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
T0=$(date +%s)
timeout 200 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --compare-graphs --repeats 3 --save $OUT/e2e-tp1-compare.md > $OUT/e2e.log 2>&1
tail -1 $OUT/e2e.log; cat $OUT/e2e-tp1-compare.md | cut -c1-400
echo "e2e $(( $(date +%s) - T0 )) s"
