# issue 22, fifth pass, final call (one GPU, embedded model joined from two halves): every GPU test, real-TP-1 NCCL sweep == emulated, e2e eager vs graphed
source .carry/setup.sh
R=/tmp/res; rm -rf $R; mkdir -p $R
export DETAUDIT_WHEEL_DIR=/tmp/smolwheel HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps -e . 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee $R/device.txt
T0=$(date +%s)
timeout 540 python3 -m pytest -v -p no:cacheprovider tests/gpu 2>&1 | grep -E "PASSED|FAILED|SKIPPED|ERROR|^E |passed|failed|\[cuda graphs\]" | tail -80 > $R/gpu-tests-all.log
tail -3 $R/gpu-tests-all.log; grep -E "FAILED|ERROR|^E " $R/gpu-tests-all.log | head; echo "tests $(( $(date +%s) - T0 )) s"
tar czf $OUT/res.tgz -C $R .
