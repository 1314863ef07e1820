source .carry/setup.sh
mkdir -p $OUT
export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
timeout 200 python3 .carry/hostsplit.py bf16 bio > $OUT/hostsplit.log 2>&1; cat $OUT/hostsplit.log | tail -40
