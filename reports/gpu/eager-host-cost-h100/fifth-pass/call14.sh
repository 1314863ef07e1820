# issue 22, fifth pass, two GPUs: the real-TP-2 GPU tests, e2e TP 1/2 eager vs graphed (same device)
source .carry/setup.sh
R=/tmp/res; rm -rf $R; mkdir -p $R
export DETAUDIT_WHEEL_DIR=/tmp/smolwheel HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee $R/device.txt
T0=$(date +%s)
timeout 240 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_gpu.py -k "engine_bio_batch or real_tp1" 2>&1 | grep -E "PASSED|FAILED|SKIPPED|ERROR|^E |passed|failed" | tail -20 > $R/gpu-tests-2gpu.log
tail -3 $R/gpu-tests-2gpu.log; echo "tests $(( $(date +%s) - T0 )) s"
timeout 300 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1,2 --batch-sizes 8,32 --new-tokens 32 --compare-graphs --repeats 3 --save $R/e2e-tp12-compare.md > $R/e2e.log 2>&1
grep "^| qwen" $R/e2e-tp12-compare.md | awk -F'|' '{print $3,$4,$5,$10,$11,$13,$17}'
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/res.tgz -C $R .
