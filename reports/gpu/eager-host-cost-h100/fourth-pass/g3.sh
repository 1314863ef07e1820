# issue 22, fourth pass, final call (one H100): merged-operand rotary / silu, precomputed layer flags
source .carry/setup.sh
mkdir -p $OUT
export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
T0=$(date +%s)
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_fused.py tests/gpu/test_gpu.py -k "fused or rope or silu or rms or merged or kept_launch or direct_launch or hoisted or real_tp1 or qwen3" 2>&1 | grep -E "PASSED|FAILED|SKIPPED|^E |passed|failed" | tail -40 > $OUT/gpu-tests.log
tail -3 $OUT/gpu-tests.log; grep -E "FAILED|^E " $OUT/gpu-tests.log | head; echo "tests $(( $(date +%s) - T0 )) s"
timeout 200 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --compare-graphs --repeats 3 --save $OUT/e2e-tp1-compare.md > $OUT/e2e.log 2>&1
tail -2 $OUT/e2e.log; cat $OUT/e2e-tp1-compare.md | cut -c1-400
echo "e2e $(( $(date +%s) - T0 )) s"
timeout 90 python3 .carry/hostsplit.py bf16 > $OUT/hostsplit.log 2>&1; cat $OUT/hostsplit.log | tail -24
echo "total $(( $(date +%s) - T0 )) s"
