source .carry/setup.sh > /dev/null 2>&1
timeout 120 python3 .carry/sdpa_pick.py 2>&1 | grep -v Warning | tee $OUT/sdpa-pick.log
