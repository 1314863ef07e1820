source .carry/setup.sh
mkdir -p $OUT
export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
T0=$(date +%s)
for g in cuda-graphs no-cuda-graphs; do
timeout 130 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1,2 --batch-sizes 8,32 --new-tokens 32 --$g --save $OUT/e2e-tp12-$g.md > /dev/null 2>&1
grep "qwen3" $OUT/e2e-tp12-$g.md | cut -d'|' -f3,4,5,10,12,13
done
echo "bench $(( $(date +%s) - T0 )) s"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused.py 2>&1 | tail -3 > $OUT/gpu-tests-fused.log; cat $OUT/gpu-tests-fused.log
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_gpu.py -k "real_tp1 or qwen3_8b or row_ops or hoisted or kept_launch" 2>&1 | grep -E "PASSED|FAILED|^E |passed|failed" | tail -20 > $OUT/gpu-tests-engine.log
cat $OUT/gpu-tests-engine.log; echo "tests $(( $(date +%s) - T0 )) s"
S="python3 -m detaudit sweep --device cuda --model qwen3-8b-shaped --suites smoke --backends bio+tbik --tp 1 --batch-sizes 4,8 --max-new-tokens 32 --no-analyze"
DETAUDIT_TP1_GROUP=1 timeout 90 $S --tp-mode real -o /tmp/real > /dev/null 2>&1; timeout 90 $S --tp-mode emulated -o /tmp/emu >/dev/null 2>&1
python3 .carry/compare_runs.py /tmp/real /tmp/emu 2>&1 | tee $OUT/sweep-tp1-nccl-vs-emulated.log
grep -o '"cuda_graphs": [a-z]*\|"workers": [0-9]*' /tmp/real/manifest.json | sort | uniq -c | tee -a $OUT/sweep-tp1-nccl-vs-emulated.log
echo "sweeps $(( $(date +%s) - T0 )) s"
timeout 70 python3 .carry/hostprof.py bf16 bio 2>&1 | tail -50 > $OUT/hostprof.log
echo "total $(( $(date +%s) - T0 )) s"
