source .carry/setup.sh > /dev/null 2>&1
mkdir -p $OUT; export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
for f in "" 1; do FREEZE=$f PLEN=512 timeout 80 python3 .carry/hostsplit.py bf16 2>&1 | grep -v Warn | grep -E "gc counts|==|Block" | tee -a $OUT/hostsplit-gc.log; done
