# issue 22, fifth pass, call 8: real-TP-1 NCCL sweep == emulated, e2e eager vs graphed
source .carry/setup.sh
R=/tmp/res; rm -rf $R; mkdir -p $R
export DETAUDIT_WHEEL_DIR=/tmp/smolwheel HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee $R/device.txt
T0=$(date +%s)
S="python3 -m detaudit sweep --device cuda --model qwen3-8b-shaped --suites smoke --backends bio+tbik --tp 1 --batch-sizes 4,8 --max-new-tokens 32 --no-analyze"
DETAUDIT_TP1_GROUP=1 timeout 90 $S --tp-mode real -o /tmp/real > $R/sweep-real.log 2>&1; timeout 70 $S --tp-mode emulated -o /tmp/emu > $R/sweep-emu.log 2>&1
python3 .carry/s/compare_runs.py /tmp/real /tmp/emu 2>&1 | tee $R/sweep-tp1-nccl-vs-emulated.log
grep -o '"cuda_graphs": [a-z]*\|"workers": [0-9]*' /tmp/real/manifest.json | sort | uniq -c | tee -a $R/sweep-tp1-nccl-vs-emulated.log
echo "sweeps $(( $(date +%s) - T0 )) s"
timeout 100 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --compare-graphs --repeats 5 --save $R/e2e-tp1-compare.md > $R/e2e.log 2>&1
grep "^| qwen" $R/e2e-tp1-compare.md | awk -F'|' '{print $4,$5,$10,$11,$13,$17}'
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/res.tgz -C $R .
