source .carry/setup.sh
S="-m detaudit bench e2e --models qwen3-8b-shaped --batch-sizes 8,32 --new-tokens 32"
mkdir -p $OUT/r
t0=$(date +%s)
echo "== after: kernels"; python3 -m detaudit bench kernels --m 8,32,64 --save $OUT/r/kernels-after.md 2>&1 | tail -20
echo "== before: kernels"; PYTHONPATH=$PWD/.carry/old python3 -m detaudit bench kernels --m 8,32,64 --save $OUT/r/kernels-before.md 2>&1 | tail -20
echo "t=$(( $(date +%s) - t0 ))"
echo "== after: eager"; python3 $S --no-cuda-graphs --save $OUT/r/e2e-after-eager.md 2>&1 | tail -9
echo "t=$(( $(date +%s) - t0 ))"
echo "== before: eager"; PYTHONPATH=$PWD/.carry/old python3 $S --no-cuda-graphs --save $OUT/r/e2e-before-eager.md 2>&1 | tail -9
echo "t=$(( $(date +%s) - t0 ))"
echo "== after: graphed"; python3 $S --cuda-graphs --save $OUT/r/e2e-after-graphed.md 2>&1 | tail -9
echo "t=$(( $(date +%s) - t0 ))"
echo "== before: graphed"; PYTHONPATH=$PWD/.carry/old python3 $S --cuda-graphs --save $OUT/r/e2e-before-graphed.md 2>&1 | tail -9
echo "t=$(( $(date +%s) - t0 ))"
