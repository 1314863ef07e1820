mkdir -p /tmp/smol /tmp/smolwheel && cp .carry/smol/a/part.00 /tmp/smol/ && ls -la /tmp/smol && nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
