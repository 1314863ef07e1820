# issue 22, fourth pass, call 3 of 4 (2x H100): all GPU tests, kernel bench, real-TP-1 NCCL sweep == emulated
source .carry/setup.sh
mkdir -p $OUT
export DETAUDIT_WHEEL_DIR=/tmp/smolwheel HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps -e . 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee $OUT/device.txt
T0=$(date +%s)
timeout 380 python3 -m pytest -v -p no:cacheprovider tests/gpu 2>&1 | grep -E "PASSED|FAILED|SKIPPED|^E |passed|failed" | tail -60 > $OUT/gpu-tests-all.log
tail -4 $OUT/gpu-tests-all.log; grep -E "FAILED|^E " $OUT/gpu-tests-all.log | head; echo "tests $(( $(date +%s) - T0 )) s"
timeout 100 python3 -m detaudit bench kernels --m 8,32,64 --save $OUT/kernels.md > /dev/null 2>&1; tail -14 $OUT/kernels.md | cut -c1-230
echo "kernels $(( $(date +%s) - T0 )) s"
S="python3 -m detaudit sweep --device cuda --model qwen3-8b-shaped --suites smoke --backends bio+tbik --tp 1 --batch-sizes 4,8 --max-new-tokens 32 --no-analyze"
DETAUDIT_TP1_GROUP=1 timeout 90 $S --tp-mode real -o /tmp/real > /dev/null 2>&1; timeout 70 $S --tp-mode emulated -o /tmp/emu >/dev/null 2>&1
python3 .carry/compare_runs.py /tmp/real /tmp/emu 2>&1 | tee $OUT/sweep-tp1-nccl-vs-emulated.log
grep -o '"cuda_graphs": [a-z]*\|"workers": [0-9]*' /tmp/real/manifest.json | sort | uniq -c | tee -a $OUT/sweep-tp1-nccl-vs-emulated.log
echo "total $(( $(date +%s) - T0 )) s"
