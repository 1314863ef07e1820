# issue 22, fifth pass, call 1 (one GPU): host speed, old (HEAD 3c92217) vs new (pipelined decode) bf16 eager/graphed, py-spy of bf16 eager
source .carry/setup.sh
mkdir -p $OUT; export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
lscpu | grep -E "Model name|^CPU\(s\)|MHz" | tee $OUT/cpu.txt
python3 - <<'PY' | tee $OUT/hostspeed.txt
import torch, time, torch.nn.functional as F
x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16); w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
for name, f in [("F.linear", lambda: F.linear(x, w)), ("torch.empty", lambda: torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16)), ("python call", lambda: None)]:
    for _ in range(2000): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20000): f()
    h = time.perf_counter() - t; torch.cuda.synchronize(); tt = time.perf_counter() - t
    print(f"host speed: {name}: {h / 2e4 * 1e6:.2f} us/call host, {tt / 2e4 * 1e6:.2f} us/call with the device")
PY
B="bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8,32 --new-tokens 32 --backends bf16 --compare-graphs --repeats 3"
S0=$(date +%s)
for v in old new old new; do
  T0=$(date +%s); [ $(( T0 - S0 )) -gt 300 ] && break
  if [ $v = old ]; then PP=$PWD/.carry/old; else PP=$PWD; fi
  PYTHONPATH=$PP timeout 170 python3 -m detaudit $B --save $OUT/e2e-$v-$T0.md > $OUT/e2e-$v-$T0.log 2>&1
  echo "$v $(( $(date +%s) - T0 )) s"; grep "^| qwen" $OUT/e2e-$v-$T0.md | awk -F'|' '{print $4,$5,$10,$12,$15,$16,$17}'
done
timeout 120 py-spy record -r 250 -f raw -o $OUT/pyspy-bf16-eager.txt -- python3 -m detaudit bench e2e --models qwen3-8b-shaped --tp 1 --batch-sizes 8 --new-tokens 32 --backends bf16 --no-cuda-graphs --repeats 3 > $OUT/pyspy-run.log 2>&1
echo "py-spy rc $?"; tail -3 $OUT/pyspy-run.log; ls -la $OUT
