# issue 22, fifth pass, call 5 (one GPU): GPU tests of the changes; e2e old (3c92217) vs new, alternated, same machine
source .carry/setup.sh
R=/tmp/res; rm -rf $R; mkdir -p $R; export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/device.txt
timeout 300 python3 -m pytest -q tests/gpu/test_fused.py tests/gpu/test_gpu.py -k "fused or rope or silu or rms or merged or qwen3 or real_tp1 or hoisted or kept_launch or direct_launch or bf16_products" 2>&1 | tail -4 | tee $R/gpu-tests.log
B="bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --compare-graphs --repeats 5"
for v in old new old new; do
  if [ $v = old ]; then PP=$PWD/.carry/old; else PP=$PWD; fi
  T0=$(date +%s)
  PYTHONPATH=$PP timeout 120 python3 -m detaudit $B --save $R/e2e-$v-$T0.md > $R/e2e-$v-$T0.log 2>&1
  echo "$v $(( $(date +%s) - T0 )) s"
  python3 -c "
import pandas as pd, io, sys
t = open('$R/e2e-$v-$T0.md').read().split('\n'); rows = [l for l in t if l.startswith('|')]
df = pd.read_csv(io.StringIO('\n'.join(rows)), sep='|', skipinitialspace=True).iloc[1:, 1:-1]
df.columns = [c.strip() for c in df.columns]
cols = [c for c in ('backend', 'batch', 'cuda_graphs', 'ms_per_step', 'host_ms_per_step', 'ms_per_step_min', 'ms_per_step_max', 'graphed_speedup') if c in df.columns]
print(df[cols].to_string(index=False))"
done
tar czf $OUT/res.tgz -C $R .
