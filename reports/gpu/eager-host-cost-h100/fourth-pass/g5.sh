source .carry/setup.sh > /dev/null 2>&1
mkdir -p $OUT; export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
timeout 150 python3 .carry/prof_bf16.py 2>&1 | grep -v Warning | cut -c1-200 | tee $OUT/prof-bf16.log | tail -60
