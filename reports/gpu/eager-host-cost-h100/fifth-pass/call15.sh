# issue 22, fifth pass, two GPUs: the AIME24 / AMC23 audit, real TP 1 and 2 (NCCL), CUDA graphs on
source .carry/setup.sh
R=/tmp/res; rm -rf $R; mkdir -p $R
export DETAUDIT_WHEEL_DIR=/tmp/smolwheel HF_HUB_OFFLINE=1
T0=$(date +%s)
timeout 420 python3 -m detaudit sweep --device cuda --model smollm2-135m --suites aime24,amc23 --limit 40 --data-dir .carry/suites \
  --backends bf16,bio,bio+tbik --tp 1,2 --tp-mode real --batch-sizes 8,16,32 --max-new-tokens 128 \
  --temperature 0.7 --top-p 0.8 --top-k 20 --seed 42 -o $R/audit 2>&1 | tail -60 > $R/audit-sweep.log
echo "audit wall $(( $(date +%s) - T0 )) s" | tee -a $R/audit-sweep.log
tail -42 $R/audit-sweep.log
grep -c recvValue $R/audit-sweep.log
rm -rf $R/audit/cells
tar czf $OUT/res.tgz -C $R .
