# issue 22, fifth pass, call 16 (nvidia-h100-x1): bench kernels (eager per-call columns) and e2e eager vs graphed, final code
source .carry/setup.sh
R=/tmp/res; rm -rf $R; mkdir -p $R; export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/device.txt
timeout 150 python3 -m detaudit bench kernels --m 8,32,64 --save $R/kernels.md > $R/kernels.log 2>&1; grep "^|" $R/kernels.md | cut -c1-260
timeout 150 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --compare-graphs --repeats 5 --save $R/e2e-tp1-compare.md > $R/e2e.log 2>&1
grep "^| qwen" $R/e2e-tp1-compare.md | awk -F'|' '{print $4,$5,$10,$11,$13,$17}'
tar czf $OUT/res.tgz -C $R .
