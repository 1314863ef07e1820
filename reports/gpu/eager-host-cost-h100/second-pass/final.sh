source .carry/setup.sh
mkdir -p $OUT/r
t0=$(date +%s)
echo "== pytest tests/gpu"; python3 -m pytest -q tests/gpu 2>&1 | tail -6
echo "t=$(( $(date +%s) - t0 ))"
echo "== old vs new outputs"; PYTHONPATH=$PWD/.carry/old python3 .carry/same.py save /tmp/old.json 2>&1 | tail -3; python3 .carry/same.py compare /tmp/old.json 2>&1 | tail -12
echo "t=$(( $(date +%s) - t0 ))"
S="-m detaudit bench e2e --models qwen3-8b-shaped --batch-sizes 8,32 --new-tokens 32 --no-cuda-graphs"
echo "== after: eager (2)"; python3 $S --save $OUT/r/e2e-after-eager-2.md 2>&1 | tail -9
echo "== before: eager (2)"; PYTHONPATH=$PWD/.carry/old python3 $S --save $OUT/r/e2e-before-eager-2.md 2>&1 | tail -9
echo "t=$(( $(date +%s) - t0 ))"
echo "== profile (after)"; python3 .carry/prof.py bf16 bio bio+tbik > $OUT/r/profile-after.log 2>&1; grep "eager step ms\|Self CPU time total\|cudaLaunchKernel \|cuLaunchKernelEx \|cudaMemcpyAsync\|cudnn" $OUT/r/profile-after.log
echo "t=$(( $(date +%s) - t0 ))"
