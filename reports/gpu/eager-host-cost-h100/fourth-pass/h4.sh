# issue 22, fourth pass, call 4 of 4 (2x H100): e2e TP 1/2 eager vs graphed (same device, 3 repeats), TP 1/2 audit
source .carry/setup.sh
mkdir -p $OUT
export DETAUDIT_WHEEL_DIR=/tmp/smolwheel HF_HUB_OFFLINE=1
T0=$(date +%s)
timeout 290 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1,2 --batch-sizes 8,32 --new-tokens 32 --compare-graphs --repeats 3 --save $OUT/e2e-tp12-compare.md > $OUT/e2e.log 2>&1
tail -3 $OUT/e2e.log; cat $OUT/e2e-tp12-compare.md | cut -c1-400
echo "e2e $(( $(date +%s) - T0 )) s"
timeout 280 python3 -m detaudit sweep --device cuda --model smollm2-135m --suites aime24,amc23 --limit 40 --data-dir .carry/suites \
  --backends bf16,bio,bio+tbik --tp 1,2 --tp-mode real --batch-sizes 8,16,32 --max-new-tokens 128 \
  --temperature 0.7 --top-p 0.8 --top-k 20 --seed 42 -o $OUT/audit 2>&1 | tail -60 > $OUT/audit-sweep.log
echo "audit wall $(( $(date +%s) - T0 )) s" | tee -a $OUT/audit-sweep.log
tail -40 $OUT/audit-sweep.log
rm -rf $OUT/audit/cells
