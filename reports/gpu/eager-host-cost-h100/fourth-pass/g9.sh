source .carry/setup.sh > /dev/null 2>&1
mkdir -p $OUT; export HF_HUB_OFFLINE=1 DETAUDIT_WHEEL_DIR=/tmp/no-wheels
timeout 120 python3 -m detaudit sweep --device cuda --model qwen3-8b-shaped --suites smoke --backends bio+tbik --tp 2 --tp-mode real --batch-sizes 4 --max-new-tokens 8 --no-analyze -o /tmp/t2 > $OUT/teardown.log 2>&1; echo "rc $?"
echo "recvValue lines: $(grep -c recvValue $OUT/teardown.log)"; tail -4 $OUT/teardown.log | cut -c1-200
