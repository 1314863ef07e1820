# issue 22, fifth pass, call 6 (one GPU): e2e old (3c92217, run from its own directory so `-m` imports it) vs new, alternated, same machine
source .carry/setup.sh
R=/tmp/res; rm -rf $R; mkdir -p $R; export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/device.txt
python3 - <<'PY' | tee $R/hostspeed.txt
import torch, time
x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
for _ in range(2000): torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16)
t = time.perf_counter()
for _ in range(20000): torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16)
print(f"host speed: torch.empty {(time.perf_counter() - t) / 2e4 * 1e6:.2f} us/call")
PY
ROOT=$PWD
B="bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --compare-graphs --repeats 5"
for v in old new old new; do
  if [ $v = old ]; then D=$ROOT/.carry/old; else D=$ROOT; fi
  T0=$(date +%s)
  (cd $D && PYTHONPATH=$D python3 -c "import detaudit, sys; print('$v code:', detaudit.__file__)" && PYTHONPATH=$D timeout 120 python3 -m detaudit $B --save $R/e2e-$v-$T0.md > $R/e2e-$v-$T0.log 2>&1)
  echo "$v $(( $(date +%s) - T0 )) s"
  python3 -c "
import pandas as pd, io
t = open('$R/e2e-$v-$T0.md').read().split('\n'); rows = [l for l in t if l.startswith('|')]
df = pd.read_csv(io.StringIO('\n'.join(rows)), sep='|', skipinitialspace=True).iloc[1:, 1:-1]
df.columns = [c.strip() for c in df.columns]
cols = [c for c in ('backend', 'batch', 'cuda_graphs', 'ms_per_step', 'host_ms_per_step', 'ms_per_step_min', 'ms_per_step_max', 'graphed_speedup') if c in df.columns]
print(df[cols].to_string(index=False))"
done
tar czf $OUT/res.tgz -C $R .
