source .carry/setup.sh > /dev/null 2>&1
mkdir -p $OUT; export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
for p in 512 128; do PLEN=$p timeout 80 python3 .carry/hostsplit.py bf16 2>&1 | grep -v Warn | tee -a $OUT/hostsplit-plen.log; done
