# issue 22, fifth pass, call 3 (one GPU): bf16 library-call host costs; e2e with host_ms_per_step (pipelined decode); qwen3 GPU tests
source .carry/setup.sh
R=/tmp/res; rm -rf $R; mkdir -p $R; export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
python3 .carry/s/ops.py 2>&1 | grep -v Warn | tee $R/ops.log
timeout 200 python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --compare-graphs --repeats 3 --save $R/e2e.md > $R/e2e.log 2>&1
grep "^| qwen" $R/e2e.md | awk -F'|' '{print $4,$5,$10,$11,$13,$16,$17,$18}'
timeout 240 python3 -m pytest -q -x tests/gpu/test_gpu.py -k "qwen3 or real_tp1 or hoisted or kept_launch or direct_launch" 2>&1 | tail -4 | tee $R/gpu-tests.log
tar czf $OUT/res.tgz -C $R .
