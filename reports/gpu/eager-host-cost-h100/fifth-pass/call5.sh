# issue 22, fifth pass, call 4: host cost per eager decode step on a deep tiny Qwen3 (GPU time small), old vs new; py-spy per backend
source .carry/setup.sh
R=/tmp/res; rm -rf $R; mkdir -p $R; export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
nvidia-smi --query-gpu=name --format=csv,noheader
python3 .carry/s/tinydeep.py /tmp/tinydeep .carry/home/models/qwen3-8b-shaped 2>&1 | tail -1
B="bench e2e --models /tmp/tinydeep --tp 1 --batch-sizes 8 --new-tokens 32 --no-cuda-graphs --repeats 5"
for v in old new old new; do
  if [ $v = old ]; then PP=$PWD/.carry/old; else PP=$PWD; fi
  T0=$(date +%s)
  PYTHONPATH=$PP timeout 100 python3 -m detaudit $B --save $R/tiny-$v-$T0.md > $R/tiny-$v-$T0.log 2>&1
  echo "$v $(( $(date +%s) - T0 )) s"; grep "^| " $R/tiny-$v-$T0.md | grep -v "model\|:--" | awk -F'|' '{print $4,$5,$10,$11,$15,$16,$17}'
done
for b in bf16 bio; do
  timeout 100 py-spy record --nonblocking -r 400 -f raw -o $R/pyspy-$b.txt -- python3 -m detaudit bench e2e --models /tmp/tinydeep --tp 1 --batch-sizes 8 --new-tokens 64 --backends $b --no-cuda-graphs --repeats 5 > $R/pyspy-$b.log 2>&1
  echo "py-spy $b rc $?"
done
tar czf $OUT/res.tgz -C $R .
